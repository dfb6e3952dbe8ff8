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
        contenders,
        settings: DispatchSettings::default(),
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
        .score
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
    assert!(sluicegate::eval::within_slo_budget(&r.score));
    // Cap 0 is always within the budget; on steady load with slack the
    // search must find a positive cap that harvests something.
    let cap: u32 = r
        .detail
        .as_deref()
        .and_then(|d| d.strip_prefix("cap "))
        .and_then(|c| c.parse().ok())
        .expect("the oracle names its cap");
    assert!(cap > 0, "{:?}", r.detail);
    assert!(r.score.batch_tokens_per_s > 0.0, "{:?}", r.score);
    assert!(matches!(
        contender::find(&contender::built_in().unwrap(), "static-cap-oracle")
            .unwrap()
            .kind,
        Kind::StaticOracle
    ));
}

#[test]
fn the_same_seed_gives_the_same_figures() {
    let o = options(
        &[Shape::Waves],
        named(&["vllm", "upstream-per-poll", "static-cap-8"]),
        0.1,
    );
    let a = serde_json::to_string(&evaluate(&o, &|_| {}).unwrap()).unwrap();
    let b = serde_json::to_string(&evaluate(&o, &|_| {}).unwrap()).unwrap();
    assert_eq!(a, b);
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
    assert!(report.scenarios[0].rows[0].score.batch_tokens_per_s > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}
