//! One run over time as an SVG (drawn by [`crate::chart`]): why the gate
//! opened and closed (interactive load, KV use), what it granted (budget,
//! window) and what it cost (interactive TTFT p99 against the batch-free
//! twin, batch in flight).

use crate::chart::{ChartError, Line, LineStyle, Panel, render_svg};

use super::{Row, ScenarioReport};

/// The SVG of `row` in scenario `sc`.
pub fn timeline_svg(sc: &ScenarioReport, row: &Row) -> Result<String, ChartError> {
    let run = &row.timeline;
    let base = &sc.baseline_timeline;
    let series = |f: &dyn Fn(&crate::sim::runner::SeriesPoint) -> f64| {
        run.series.iter().map(|p| (p.t, f(p))).collect::<Vec<_>>()
    };
    let mut panels = vec![
        Panel {
            title: "Interactive load: what the gate must make room for".to_owned(),
            y_label: "requests/s".to_owned(),
            lines: vec![Line::new(
                "interactive arrivals (per 10 s)",
                base.interactive_rate.clone(),
                LineStyle::solid(),
            )],
            y_range: None,
        },
        Panel {
            title: "Interactive TTFT p99: the cost to interactive users".to_owned(),
            y_label: "seconds".to_owned(),
            lines: vec![
                Line::new(
                    format!("with batch ({})", row.contender),
                    run.ttft_p99.clone(),
                    LineStyle::solid().with_color(214, 39, 40),
                ),
                Line::new(
                    "without batch (baseline)",
                    base.ttft_p99.clone(),
                    LineStyle::dashed().with_color(31, 119, 180),
                ),
            ],
            y_range: None,
        },
        Panel {
            title: "Batch in flight: the harvest".to_owned(),
            y_label: "requests".to_owned(),
            lines: vec![Line::new(
                "batch in flight",
                series(&|p| f64::from(p.batch_in_flight)),
                LineStyle::solid(),
            )],
            y_range: None,
        },
    ];
    if !run.readings.is_empty() {
        let budget: Vec<(f64, f64)> = run.readings.iter().map(|r| (r.t, r.budget)).collect();
        let baseline: Vec<(f64, f64)> = run.readings.iter().map(|r| (r.t, r.baseline)).collect();
        panels[2].lines.push(Line::new(
            "window limit",
            run.readings
                .iter()
                .map(|r| (r.t, r.window.map_or(0.0, |w| w as f64)))
                .collect(),
            LineStyle::dashed(),
        ));
        panels.push(Panel {
            title: "Gate reading: budget D against baseline B".to_owned(),
            y_label: "fraction".to_owned(),
            lines: vec![
                Line::new("budget D", budget, LineStyle::solid()),
                Line::new("baseline B", baseline, LineStyle::dashed()),
            ],
            y_range: Some((0.0, 1.0)),
        });
    }
    panels.push(Panel {
        title: "KV cache use (pool mean)".to_owned(),
        y_label: "fraction".to_owned(),
        lines: vec![
            Line::new("with batch", series(&|p| p.kv_usage), LineStyle::solid()),
            Line::new(
                "without batch",
                base.series.iter().map(|p| (p.t, p.kv_usage)).collect(),
                LineStyle::dashed(),
            ),
        ],
        y_range: Some((0.0, 1.0)),
    });
    // The timeline is the first seed's run: its own figures, not the means.
    let title = match row.first() {
        Some(s) => format!(
            "{} seed {}: {} (H {:.2}, H* {:.2}, dV {:+.2} pp, rho TTFT p99 {:.2}, rho ITL p99 {:.2})",
            sc.scenario.name,
            sc.baselines.first().map_or(0, |b| b.seed_number),
            row.contender,
            s.harvest,
            s.harvest_bound,
            s.delta_v_pp,
            s.rho_ttft,
            s.rho_itl
        ),
        None => format!("{}: {}", sc.scenario.name, row.contender),
    };
    render_svg(&title, "simulated time (s)", &panels)
}
