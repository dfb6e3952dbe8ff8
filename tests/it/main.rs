//! Every integration suite in one test binary, one module per suite
//! (`tests/it/<suite>.rs`; a test's name in the output is
//! `<suite>::<test>`). One binary links the crate once instead of once per
//! suite, which was most of the test build (docs/contributing.md, "The
//! test command"). `support` starts the real servers the suites use.

mod support;

mod batch_api;
mod batch_api_idempotency;
mod batch_api_python;
mod batch_api_replicas;
mod batch_order;
mod batch_runner;
mod bench_smoke;
mod cli_newuser;
mod cli_run;
mod cli_ux;
mod config_load;
mod config_roundtrip;
mod congestion_storm;
mod deadline_storm;
mod demo_short;
mod deploy_lint;
mod dispatch_memory;
mod embedded_worker;
mod eval;
mod failure_storm;
mod fair_producers;
mod fair_tenants;
mod flex;
mod flex_python;
mod flex_stream;
mod gate_cascade;
mod gate_config_examples;
mod gate_dispatch;
mod gate_feedback;
mod gate_inert;
mod gate_lag;
mod gate_leased_rate;
mod gate_probe;
mod gate_prometheus;
mod gate_quota;
mod gate_redis;
mod gate_scrape;
mod gate_sql_quota;
mod gate_tier;
mod gate_tier_source;
mod gateway_client;
mod idempotent_submit;
mod merge_policy;
mod ops_monitoring;
mod pool_window;
mod pubsub_transport;
mod real_engine;
mod redis_cluster;
mod redis_delivery;
mod redis_faults;
mod redis_sentinel;
mod redis_transport;
mod shared_window;
mod sim_http;
mod sim_selfcheck;
mod soak;
mod source_prometheus;
mod sql_tls;
mod sql_transport;
mod telemetry_http;
mod traces;
mod upstream_examples;
