//! Raw serde structs: the file's shape, every field optional, unknown keys
//! rejected. Scalars are kept as JSON values so that the file (typed TOML
//! values), the environment (strings) and upstream JSON (strings or
//! numbers) all go through the same conversions in `validate`, where errors
//! name the key.

use serde::Deserialize;
use serde_json::Value;

/// The whole file.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    pub(crate) transport: Option<Value>,
    pub(crate) gateway: Option<RawGateway>,
    pub(crate) redis: Option<RawRedis>,
    pub(crate) prometheus: Option<RawPrometheus>,
    pub(crate) pubsub: Option<RawPubSub>,
    pub(crate) embedded: Option<RawEmbedded>,
    pub(crate) dispatch: Option<RawDispatch>,
    pub(crate) telemetry: Option<RawTelemetry>,
    pub(crate) queue: Option<Vec<RawQueue>>,
}

/// `[gateway]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawGateway {
    pub(crate) url: Option<Value>,
    pub(crate) request_path: Option<Value>,
    pub(crate) attempt_timeout: Option<Value>,
    pub(crate) connect_timeout: Option<Value>,
    pub(crate) max_response_bytes: Option<Value>,
    pub(crate) max_connections_per_host: Option<Value>,
    pub(crate) token: Option<Value>,
    pub(crate) token_file: Option<Value>,
    pub(crate) objective_header: Option<Value>,
    pub(crate) fairness_attribute: Option<Value>,
}

/// `[redis]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRedis {
    pub(crate) url: Option<Value>,
    pub(crate) username: Option<Value>,
    pub(crate) password: Option<Value>,
    pub(crate) password_file: Option<Value>,
}

/// `[prometheus]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPrometheus {
    pub(crate) url: Option<Value>,
    pub(crate) bearer_token: Option<Value>,
    pub(crate) bearer_token_file: Option<Value>,
    pub(crate) basic_user: Option<Value>,
    pub(crate) basic_password: Option<Value>,
    pub(crate) basic_password_file: Option<Value>,
}

/// `[pubsub]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPubSub {
    pub(crate) project_id: Option<Value>,
    pub(crate) result_topic_id: Option<Value>,
    pub(crate) emulator_host: Option<Value>,
}

/// `[embedded]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawEmbedded {
    pub(crate) path: Option<Value>,
}

/// `[dispatch]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDispatch {
    pub(crate) poll_interval: Option<Value>,
    pub(crate) max_staleness: Option<Value>,
    pub(crate) lease: Option<Value>,
    pub(crate) receive_wait: Option<Value>,
    pub(crate) max_attempts: Option<Value>,
    pub(crate) retry_initial_backoff: Option<Value>,
    pub(crate) retry_max_backoff: Option<Value>,
    pub(crate) congestion_backoff: Option<Value>,
    pub(crate) wait_requeue_delay: Option<Value>,
    pub(crate) shutdown_grace: Option<Value>,
    pub(crate) default_deadline: Option<Value>,
}

/// `[telemetry]`.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTelemetry {
    pub(crate) listen: Option<Value>,
    pub(crate) log_format: Option<Value>,
    pub(crate) log_level: Option<Value>,
}

/// One `[[queue]]` entry; also the upstream JSON queue shape.
#[derive(Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawQueue {
    pub(crate) queue_name: Option<Value>,
    /// Upstream Pub/Sub spelling of the queue's name.
    pub(crate) subscriber_id: Option<Value>,
    pub(crate) igw_base_url: Option<Value>,
    pub(crate) request_path_url: Option<Value>,
    pub(crate) inference_objective: Option<Value>,
    pub(crate) worker_pool_id: Option<Value>,
    pub(crate) labels: Option<Value>,
    pub(crate) result_queue_name: Option<Value>,
    pub(crate) result_ttl_seconds: Option<Value>,
    pub(crate) max_sys: Option<Value>,
    pub(crate) unit: Option<Value>,
    pub(crate) rounding: Option<Value>,
    pub(crate) gate_type: Option<Value>,
    pub(crate) gate_params: Option<Value>,
}

/// Keys of each section, for the generic environment overlay and docs.
pub(crate) const GATEWAY_KEYS: &[&str] = &[
    "url",
    "request_path",
    "attempt_timeout",
    "connect_timeout",
    "max_response_bytes",
    "max_connections_per_host",
    "token",
    "token_file",
    "objective_header",
    "fairness_attribute",
];
/// `[redis]` keys.
pub(crate) const REDIS_KEYS: &[&str] = &["url", "username", "password", "password_file"];
/// `[prometheus]` keys.
pub(crate) const PROMETHEUS_KEYS: &[&str] = &[
    "url",
    "bearer_token",
    "bearer_token_file",
    "basic_user",
    "basic_password",
    "basic_password_file",
];
/// `[pubsub]` keys.
pub(crate) const PUBSUB_KEYS: &[&str] = &["project_id", "result_topic_id", "emulator_host"];
/// `[embedded]` keys.
pub(crate) const EMBEDDED_KEYS: &[&str] = &["path"];
/// `[dispatch]` keys.
pub(crate) const DISPATCH_KEYS: &[&str] = &[
    "poll_interval",
    "max_staleness",
    "lease",
    "receive_wait",
    "max_attempts",
    "retry_initial_backoff",
    "retry_max_backoff",
    "congestion_backoff",
    "wait_requeue_delay",
    "shutdown_grace",
    "default_deadline",
];
/// `[telemetry]` keys.
pub(crate) const TELEMETRY_KEYS: &[&str] = &["listen", "log_format", "log_level"];
/// Every section with its scalar keys: the one list the environment
/// overlay, unknown-key pruning and the slot test walk.
pub(crate) const SECTIONS: &[(&str, &[&str])] = &[
    ("gateway", GATEWAY_KEYS),
    ("redis", REDIS_KEYS),
    ("prometheus", PROMETHEUS_KEYS),
    ("pubsub", PUBSUB_KEYS),
    ("embedded", EMBEDDED_KEYS),
    ("dispatch", DISPATCH_KEYS),
    ("telemetry", TELEMETRY_KEYS),
];

/// `[[queue]]` keys settable through `SLUICEGATE_QUEUE_<KEY>` (the name,
/// gate type and gate params have their own contract variables).
pub(crate) const QUEUE_ENV_KEYS: &[&str] = &[
    "igw_base_url",
    "request_path_url",
    "inference_objective",
    "worker_pool_id",
    "labels",
    "result_queue_name",
    "result_ttl_seconds",
    "max_sys",
    "unit",
    "rounding",
];

impl RawConfig {
    /// The slot for `[section] key`, creating the section. `None` when the
    /// pair is not a scalar key of the schema.
    pub(crate) fn slot(&mut self, section: &str, key: &str) -> Option<&mut Option<Value>> {
        Some(match section {
            "gateway" => {
                let g = self.gateway.get_or_insert_with(Default::default);
                match key {
                    "url" => &mut g.url,
                    "request_path" => &mut g.request_path,
                    "attempt_timeout" => &mut g.attempt_timeout,
                    "connect_timeout" => &mut g.connect_timeout,
                    "max_response_bytes" => &mut g.max_response_bytes,
                    "max_connections_per_host" => &mut g.max_connections_per_host,
                    "token" => &mut g.token,
                    "token_file" => &mut g.token_file,
                    "objective_header" => &mut g.objective_header,
                    "fairness_attribute" => &mut g.fairness_attribute,
                    _ => return None,
                }
            }
            "redis" => {
                let r = self.redis.get_or_insert_with(Default::default);
                match key {
                    "url" => &mut r.url,
                    "username" => &mut r.username,
                    "password" => &mut r.password,
                    "password_file" => &mut r.password_file,
                    _ => return None,
                }
            }
            "prometheus" => {
                let p = self.prometheus.get_or_insert_with(Default::default);
                match key {
                    "url" => &mut p.url,
                    "bearer_token" => &mut p.bearer_token,
                    "bearer_token_file" => &mut p.bearer_token_file,
                    "basic_user" => &mut p.basic_user,
                    "basic_password" => &mut p.basic_password,
                    "basic_password_file" => &mut p.basic_password_file,
                    _ => return None,
                }
            }
            "pubsub" => {
                let p = self.pubsub.get_or_insert_with(Default::default);
                match key {
                    "project_id" => &mut p.project_id,
                    "result_topic_id" => &mut p.result_topic_id,
                    "emulator_host" => &mut p.emulator_host,
                    _ => return None,
                }
            }
            "embedded" => {
                let e = self.embedded.get_or_insert_with(Default::default);
                match key {
                    "path" => &mut e.path,
                    _ => return None,
                }
            }
            "dispatch" => {
                let d = self.dispatch.get_or_insert_with(Default::default);
                match key {
                    "poll_interval" => &mut d.poll_interval,
                    "max_staleness" => &mut d.max_staleness,
                    "lease" => &mut d.lease,
                    "receive_wait" => &mut d.receive_wait,
                    "max_attempts" => &mut d.max_attempts,
                    "retry_initial_backoff" => &mut d.retry_initial_backoff,
                    "retry_max_backoff" => &mut d.retry_max_backoff,
                    "congestion_backoff" => &mut d.congestion_backoff,
                    "wait_requeue_delay" => &mut d.wait_requeue_delay,
                    "shutdown_grace" => &mut d.shutdown_grace,
                    "default_deadline" => &mut d.default_deadline,
                    _ => return None,
                }
            }
            "telemetry" => {
                let t = self.telemetry.get_or_insert_with(Default::default);
                match key {
                    "listen" => &mut t.listen,
                    "log_format" => &mut t.log_format,
                    "log_level" => &mut t.log_level,
                    _ => return None,
                }
            }
            _ => return None,
        })
    }
}

impl RawQueue {
    /// The slot for a queue key, `None` when unknown.
    pub(crate) fn slot(&mut self, key: &str) -> Option<&mut Option<Value>> {
        Some(match key {
            "queue_name" => &mut self.queue_name,
            "igw_base_url" => &mut self.igw_base_url,
            "request_path_url" => &mut self.request_path_url,
            "inference_objective" => &mut self.inference_objective,
            "worker_pool_id" => &mut self.worker_pool_id,
            "labels" => &mut self.labels,
            "result_queue_name" => &mut self.result_queue_name,
            "result_ttl_seconds" => &mut self.result_ttl_seconds,
            "max_sys" => &mut self.max_sys,
            "unit" => &mut self.unit,
            "rounding" => &mut self.rounding,
            "gate_type" => &mut self.gate_type,
            "gate_params" => &mut self.gate_params,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_key_has_a_slot() {
        let mut raw = RawConfig::default();
        for &(section, keys) in SECTIONS {
            for key in keys {
                assert!(raw.slot(section, key).is_some(), "{section}.{key}");
            }
        }
        let mut q = RawQueue::default();
        for key in QUEUE_ENV_KEYS {
            assert!(q.slot(key).is_some(), "queue.{key}");
        }
        assert!(raw.slot("gateway", "nope").is_none());
        assert!(raw.slot("nope", "url").is_none());
    }
}
