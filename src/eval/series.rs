//! A scenario's runs second by second, as CSV (`eval --csv`): what the
//! SVG draws, in numbers, so a reader can see *when* a gate loses harvest
//! or breaks the SLO (a wave's first seconds, a sawtooth) and compare two
//! gates or two paces on the same seconds.
//!
//! One row per contender and simulated second of the first seed's run,
//! the baseline (no batch) first. Pure: builds the text, writes nothing.

use std::fmt::Write as _;

use super::{GateSample, ScenarioReport, Timeline};

/// The CSV header; one row per contender and second.
pub const HEADER: &str = "contender,t_s,batch_in_flight,interactive_in_flight,waiting,\
batch_released_total,batch_tokens_total,interactive_judged,interactive_violations,budget,window";

/// The baseline and every row of `sc`, second by second.
pub fn timeline_csv(sc: &ScenarioReport) -> String {
    let mut out = String::from(HEADER);
    out.push('\n');
    write_rows(&mut out, "baseline", &sc.baseline_timeline);
    for row in &sc.rows {
        let name = match &row.detail {
            Some(detail) => format!("{} ({detail})", row.contender),
            None => row.contender.clone(),
        };
        write_rows(&mut out, &name, &row.timeline);
    }
    out
}

fn write_rows(out: &mut String, contender: &str, tl: &Timeline) {
    // Names are ours or the user's `--gate-spec` names: quote, doubling
    // any quote, so a comma in a name cannot shift the columns.
    let name = format!("\"{}\"", contender.replace('"', "\"\""));
    for p in &tl.series {
        // Interactive requests that arrived in the second ending at `t`.
        let (judged, violated) = tl
            .violations
            .iter()
            .find(|(end, _, _)| (end - p.t).abs() < 1e-6)
            .map_or((0, 0), |&(_, j, v)| (j, v));
        let (budget, window) = match last_reading(&tl.readings, p.t) {
            Some(g) => (
                format!("{:.4}", g.budget),
                g.window.map(|w| w.to_string()).unwrap_or_default(),
            ),
            None => (String::new(), String::new()),
        };
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{name},{:.1},{},{},{},{},{},{judged},{violated},{budget},{window}",
            p.t,
            p.batch_in_flight,
            p.interactive_in_flight,
            p.waiting,
            p.batch_released_total,
            p.batch_tokens_total,
        );
    }
}

/// The gate's last reading at or before `t`.
fn last_reading(readings: &[GateSample], t: f64) -> Option<&GateSample> {
    readings.iter().take_while(|g| g.t <= t + 1e-9).last()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, budget: f64, window: Option<u64>) -> GateSample {
        GateSample {
            t,
            budget,
            baseline: 0.0,
            n: 0,
            window,
            source_available: true,
        }
    }

    #[test]
    fn a_second_shows_the_last_reading_at_or_before_it() {
        let readings = [
            sample(0.5, 0.2, Some(3)),
            sample(1.0, 0.4, Some(5)),
            sample(1.7, 0.1, None),
        ];
        assert!(last_reading(&readings, 0.4).is_none());
        assert_eq!(last_reading(&readings, 1.0).map(|g| g.budget), Some(0.4));
        assert_eq!(last_reading(&readings, 1.9).map(|g| g.window), Some(None));
    }
}
