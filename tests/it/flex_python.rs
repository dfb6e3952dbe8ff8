//! Flex requests and background responses driven by the official
//! `openai` Python client, unchanged (`tests/python/flex_client.py`),
//! against real servers and our simulator as the pool. The client lives
//! in `target/py-venv`, which `scripts/test.sh` creates; without it this
//! test fails and says how to make it (set `SLUICEGATE_SKIP_PYTHON_SUITE=1`
//! to skip it knowingly).

use std::time::Duration;

use crate::support::pytest::{run_pytest, venv_python};
use crate::support::serve::{ServeSpec, start};
use crate::support::sim::small_pool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_drives_flex_and_background_responses() {
    let Some(python) = venv_python("the openai Python flex suite") else {
        return;
    };
    let sim = small_pool().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.keys = Some("alice:key-alice,bob:key-bob".into());
    let open = start(&spec, None).await;
    spec.closed_gate = true;
    spec.flex_max_wait = Some(Duration::from_secs(1));
    let closed = start(&spec, None).await;
    // A pool whose decode is slow: a streamed answer is seen arriving
    // while the engine still runs it.
    let mut cfg = sluicegate::sim::SimConfig {
        pool_name: "p".into(),
        replicas: 1,
        ..sluicegate::sim::SimConfig::default()
    };
    cfg.engine.step.c0_ms = 25.0;
    let slow_sim = sluicegate::sim::spawn_http(cfg)
        .await
        .expect("simulator starts");
    let mut slow_spec = ServeSpec::new(&slow_sim.base_url());
    slow_spec.keys = spec.keys.clone();
    let slow = start(&slow_spec, None).await;
    let env = vec![
        ("SLUICEGATE_FLEX_SLOW", slow.base.clone()),
        ("SLUICEGATE_FLEX_SLOW_SIM", slow_sim.base_url()),
        ("SLUICEGATE_FLEX_BASE", open.base.clone()),
        ("SLUICEGATE_FLEX_CLOSED", closed.base.clone()),
        (
            "SLUICEGATE_FLEX_CLOSED_METRICS",
            format!("http://{}/metrics", closed.server.telemetry_addr),
        ),
        ("SLUICEGATE_KEY_A", "key-alice".into()),
        ("SLUICEGATE_KEY_B", "key-bob".into()),
    ];
    run_pytest(python, "tests/python/flex_client.py", env, 9).await;
    open.stop().await;
    closed.stop().await;
    slow.stop().await;
    sim.shutdown().await.expect("simulator stops");
    slow_sim.shutdown().await.expect("simulator stops");
}
