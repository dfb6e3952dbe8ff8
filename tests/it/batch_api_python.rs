//! The Batch API driven by the official `openai` Python client
//! (`tests/python/test_batch_api.py`, `test_idempotency.py`), against real servers and our
//! simulator as the pool. The client lives in `target/py-venv`, which
//! `scripts/test.sh` creates; without it this test fails and says how to
//! make it (set `SLUICEGATE_SKIP_PYTHON_SUITE=1` to skip it knowingly).

use crate::support::pytest::{run_pytest, venv_python};
use crate::support::serve::{ServeSpec, start};
use crate::support::sim::small_pool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_drives_the_batch_api() {
    let Some(python) = venv_python("the openai Python client suite") else {
        return;
    };
    let sim = small_pool().await;
    let keys = "alice:key-alice,bob:key-bob";
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.keys = Some(keys.into());
    let open = start(&spec, None).await;
    spec.closed_gate = true;
    let closed = start(&spec, None).await;
    spec.closed_gate = false;
    spec.file_retention = Some(std::time::Duration::from_secs(2));
    let short = start(&spec, None).await;
    spec.file_retention = None;
    spec.closed_gate = true;
    spec.tenant_limits = Some(sluicegate::serve::quota::TenantLimits {
        default: sluicegate::serve::quota::TenantLimit {
            requests: Some(3),
            tokens: None,
        },
        tenants: Default::default(),
    });
    let limited = start(&spec, None).await;
    let env = vec![
        ("SLUICEGATE_API_BASE", open.base.clone()),
        ("SLUICEGATE_API_BASE_CLOSED", closed.base.clone()),
        ("SLUICEGATE_API_BASE_SHORT", short.base.clone()),
        ("SLUICEGATE_API_BASE_LIMITED", limited.base.clone()),
        ("SLUICEGATE_KEY_A", "key-alice".into()),
        ("SLUICEGATE_KEY_B", "key-bob".into()),
    ];
    run_pytest(python, "tests/python", env, 20).await;
    open.stop().await;
    closed.stop().await;
    short.stop().await;
    limited.stop().await;
    sim.shutdown().await.expect("simulator stops");
}
