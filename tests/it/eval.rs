//! `sluicegate eval` in the test suite: short deterministic runs that check
//! invariants of the evaluation (never performance thresholds).

use sluicegate::dispatch::DispatchSettings;
use sluicegate::eval::{
    Contender, Kind, Options, PoolSize, Report, Scenario, Shape, Slo, contender, evaluate,
};

fn options(shapes: &[Shape], contenders: Vec<Contender>, scale: f64) -> Options {
    Options {
        scenarios: shapes
            .iter()
            .map(|&s| Scenario::built_in(s, PoolSize::Small, scale))
            .collect(),
        seeds: vec![0],
        contenders,
        settings: DispatchSettings::default(),
        pool_max_sys: false,
        slo: Slo::default(),
        threads: 2,
    }
}

fn named(names: &[&str]) -> Vec<Contender> {
    let all = contender::built_in().expect("built-in contenders");
    names
        .iter()
        .map(|n| contender::find(&all, n).unwrap_or_else(|| panic!("no contender {n}")))
        .collect()
}

fn row<'a>(report: &'a Report, scenario: usize, name: &str) -> &'a sluicegate::eval::Score {
    &report.scenarios[scenario]
        .rows
        .iter()
        .find(|r| r.contender == name)
        .unwrap_or_else(|| panic!("no row {name}"))
        .runs[0]
}

#[test]
fn metric_gates_dispatch_nothing_while_metrics_are_dark() {
    // The blackout lasts 60 s; the scenario is shortened around it.
    let o = options(
        &[Shape::Blackout],
        named(&[
            "prometheus-budget",
            "prometheus-saturation",
            "vllm",
            "ungated",
        ]),
        0.4,
    );
    let report = evaluate(&o, &|_| {}).unwrap();
    for gate in ["prometheus-budget", "prometheus-saturation", "vllm"] {
        assert_eq!(row(&report, 0, gate).dark_dispatches, 0, "{gate}");
    }
    // The count is real: the ungated baseline is not counted (it has no
    // gate), so check the harness sees the blackout through a blind gate.
    let blind = Contender::gate("constant", "constant", &serde_json::json!({})).unwrap();
    let report = evaluate(&options(&[Shape::Blackout], vec![blind], 0.4), &|_| {}).unwrap();
    assert!(row(&report, 0, "constant").dark_dispatches > 0);
}

#[test]
fn ungated_batch_breaks_the_slo_and_a_zero_cap_harvests_nothing() {
    let o = options(&[Shape::Steady], named(&["ungated", "static-cap-0"]), 0.1);
    let report = evaluate(&o, &|_| {}).unwrap();
    let ungated = row(&report, 0, "ungated");
    assert!(ungated.delta_v_pp > 20.0, "{ungated:?}");
    assert!(ungated.rho_ttft > 2.0, "{ungated:?}");
    let zero = row(&report, 0, "static-cap-0");
    assert_eq!(zero.harvest, 0.0);
    assert_eq!(zero.batch_tokens_per_s, 0.0);
    assert_eq!(zero.delta_v_pp, 0.0);
}

#[test]
fn the_oracle_reports_a_cap_within_the_slo_budget() {
    let o = options(&[Shape::Steady], named(&["static-cap-oracle"]), 0.1);
    let report = evaluate(&o, &|_| {}).unwrap();
    let r = &report.scenarios[0].rows[0];
    assert!(r.detail.as_deref().is_some_and(|d| d.starts_with("cap ")));
    assert!(sluicegate::eval::within_slo_budget(
        &r.runs[0],
        Slo::default()
    ));
    assert!(r.summary.within_budget);
    // Cap 0 is always within the budget; on steady load with slack the
    // search must find a positive cap that harvests something.
    let cap: u32 = r
        .detail
        .as_deref()
        .and_then(|d| d.strip_prefix("cap "))
        .and_then(|c| c.parse().ok())
        .expect("the oracle names its cap");
    assert!(cap > 0, "{:?}", r.detail);
    assert!(r.runs[0].batch_tokens_per_s > 0.0, "{:?}", r.runs[0]);
    assert!(matches!(
        contender::find(&contender::built_in().unwrap(), "static-cap-oracle")
            .unwrap()
            .kind,
        Kind::StaticOracle
    ));
}

#[test]
fn the_same_gate_and_seed_give_identical_figures() {
    let mut o = options(
        &[Shape::Waves],
        named(&["vllm", "upstream-per-poll", "static-cap-8"]),
        0.1,
    );
    o.seeds = vec![3, 4];
    let a = evaluate(&o, &|_| {}).unwrap();
    let b = evaluate(&o, &|_| {}).unwrap();
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap()
    );
    // Bit for bit: dV, H and rho of each seed, not only their rounding.
    for (ra, rb) in a.scenarios[0].rows.iter().zip(&b.scenarios[0].rows) {
        for (x, y) in ra.runs.iter().zip(&rb.runs) {
            assert_eq!(x.delta_v_pp.to_bits(), y.delta_v_pp.to_bits());
            assert_eq!(x.harvest.to_bits(), y.harvest.to_bits());
            assert_eq!(x.rho_ttft.to_bits(), y.rho_ttft.to_bits());
            assert_eq!(x.rho_itl.to_bits(), y.rho_itl.to_bits());
        }
    }
    // The two seeds are different runs.
    let vllm = &a.scenarios[0].rows[0].runs;
    assert_ne!(vllm[0].batch_tokens_per_s, vllm[1].batch_tokens_per_s);
}

#[test]
fn one_baseline_per_scenario_and_seed_is_shared_by_every_contender() {
    let mut o = options(
        &[Shape::Steady, Shape::Waves],
        named(&["static-cap-0", "static-cap-4", "ungated"]),
        0.05,
    );
    o.seeds = vec![0, 1, 2];
    let baselines = std::sync::atomic::AtomicUsize::new(0);
    let report = evaluate(&o, &|what| {
        if what.ends_with("baseline") {
            baselines.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    })
    .unwrap();
    assert_eq!(baselines.into_inner(), 2 * 3);
    for sc in &report.scenarios {
        assert_eq!(sc.baselines.len(), 3);
        // A zero cap is the baseline itself, seed by seed: with every random
        // stream paired, not a token or a violation differs.
        let zero = sc
            .rows
            .iter()
            .find(|r| r.contender == "static-cap-0")
            .unwrap();
        for run in &zero.runs {
            assert_eq!(run.delta_v_pp, 0.0);
            assert_eq!(run.rho_ttft, 1.0);
            assert_eq!(run.rho_itl, 1.0);
        }
        for row in &sc.rows {
            assert_eq!(row.runs.len(), 3, "{}", row.contender);
        }
    }
}

#[test]
fn max_sys_follows_the_pool_when_asked() {
    let mut o = options(&[Shape::Steady], named(&["static-cap-1"]), 0.05);
    o.pool_max_sys = true;
    let report = evaluate(&o, &|_| {}).unwrap();
    let pool = sluicegate::eval::capacity(PoolSize::Small, Slo::default()).unwrap();
    assert!(pool.concurrency > 0);
    assert_eq!(report.scenarios[0].max_sys, f64::from(pool.concurrency));
    o.pool_max_sys = false;
    let report = evaluate(&o, &|_| {}).unwrap();
    assert_eq!(
        report.scenarios[0].max_sys,
        DispatchSettings::default().max_sys
    );
}

#[test]
fn the_production_window_bounds_what_a_blind_gate_keeps_in_flight() {
    let blind = Contender::gate("constant", "constant", &serde_json::json!({})).unwrap();
    let mut o = options(&[Shape::Steady], vec![blind], 0.1);
    o.settings.max_sys = 8.0;
    let report = evaluate(&o, &|_| {}).unwrap();
    let series = &report.scenarios[0].rows[0].timeline.series;
    assert!(series.iter().all(|p| p.batch_in_flight <= 8));
    assert!(series.iter().any(|p| p.batch_in_flight == 8));
    let readings = &report.scenarios[0].rows[0].timeline.readings;
    assert!(
        readings.len() >= 50,
        "one reading per poll: {}",
        readings.len()
    );
}

#[test]
fn a_trace_is_replayed_as_its_own_scenario() {
    // 200 requests over about 60 s, one every 0.3 s.
    let dir = std::env::temp_dir().join(format!("sluicegate-eval-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("trace.csv");
    let mut csv = String::from("timestamp,input_tokens,output_tokens\n");
    for i in 0..200 {
        csv.push_str(&format!("{},{},{}\n", 1000.0 + 0.3 * f64::from(i), 256, 64));
    }
    std::fs::write(&path, csv).expect("write trace");
    let scenario = Scenario::trace(&path, PoolSize::Small).expect("trace scenario");
    assert_eq!(scenario.name, "trace/small");
    assert!(
        (scenario.duration_s - 59.7).abs() < 1e-9,
        "{}",
        scenario.duration_s
    );
    let o = Options {
        scenarios: vec![scenario],
        ..options(&[], named(&["static-cap-2"]), 1.0)
    };
    let report = evaluate(&o, &|_| {}).expect("evaluates");
    let arrivals: f64 = report.scenarios[0]
        .baseline_timeline
        .interactive_rate
        .iter()
        .map(|(_, per_s)| per_s * 10.0)
        .sum();
    assert!((arrivals - 200.0).abs() < 1e-6, "{arrivals}");
    assert!(report.scenarios[0].rows[0].runs[0].batch_tokens_per_s > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_csv_timeline_counts_the_violations_the_scores_report() {
    let o = options(&[Shape::Steady], named(&["ungated", "static-cap-4"]), 0.1);
    let report = evaluate(&o, &|_| {}).unwrap();
    let sc = &report.scenarios[0];
    let csv = sluicegate::eval::series::timeline_csv(sc);
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(sluicegate::eval::series::HEADER));
    // Per contender: seconds, judged, violated, most batch in flight.
    let mut per: std::collections::BTreeMap<String, (usize, u64, u64, u64)> = Default::default();
    for line in lines {
        let cols: Vec<&str> = line.split(',').collect();
        assert_eq!(cols.len(), 11, "{line}");
        let e = per.entry(cols[0].trim_matches('"').to_owned()).or_default();
        e.0 += 1;
        e.1 += cols[7].parse::<u64>().unwrap();
        e.2 += cols[8].parse::<u64>().unwrap();
        e.3 = e.3.max(cols[2].parse::<u64>().unwrap());
    }
    let seconds = sc.baseline_timeline.series.len();
    assert!(seconds > 30, "{seconds}");
    let pct = |name: &str| {
        let (n, judged, bad, _) = per[name];
        assert_eq!(n, seconds, "{name}: one row a second");
        100.0 * bad as f64 / judged as f64
    };
    // The baseline's rows give its violation rate; a contender's give its
    // rate, whose difference from the baseline's is the scored ΔV.
    let base = pct("baseline");
    assert!((base - sc.baselines[0].interactive.violations_pct).abs() < 1e-9);
    for name in ["ungated", "static-cap-4"] {
        let dv = row(&report, 0, name).delta_v_pp;
        assert!((pct(name) - base - dv).abs() < 1e-9, "{name}: {dv}");
    }
    assert_eq!(per["baseline"].3, 0, "the baseline runs no batch");
    assert_eq!(per["static-cap-4"].3, 4, "the cap fills and bounds");
    assert!(per["ungated"].3 > 4);
}
