//! What building a gate needs: [`GateContext`] (connections, credentials,
//! timings) and [`BuildError`]. Each gate builds itself from its parameters
//! ([`super::GateParams::build`]); [`build_gate`] dispatches on the spec.
//! Every catalogue name is known to the config loader; a gate whose
//! implementation is not in this build is a startup error, never an open
//! gate.

use std::time::Duration;

use super::{GateSpec, Unit};
use crate::postgres::SqlConfig;
use crate::redis::RedisConfig;
use crate::source::{
    Cached, MetricsAccess, PromAuth, PromClient, PrometheusConfig, RedisEndpoint, RedisKey, Scrape,
    Source, SourceError,
};
use crate::tasks::Tasks;

use super::DispatchGate;

/// A gate that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The gate type is valid configuration but not implemented here yet.
    #[error(
        "gate type `{gate_type}` is not available in this build; available: {}",
        GateSpec::available_types().join(", ")
    )]
    NotAvailable {
        /// The upstream gate name.
        gate_type: &'static str,
    },
    /// A composite without inner gates would be an open gate.
    #[error("composite gate has no inner gates")]
    EmptyComposite,
    /// A `prometheus-*` gate without `[prometheus]`.
    #[error(
        "gate `{gate_type}` queries Prometheus: set [prometheus] url or SLUICEGATE_PROMETHEUS_URL"
    )]
    NoPrometheus {
        /// The upstream gate name.
        gate_type: &'static str,
    },
    /// `sql-quota` without `[sql] url`.
    #[error(
        "gate `{gate_type}` counts in PostgreSQL: set [sql] url, SLUICEGATE_SQL_URL or SQL_URL"
    )]
    NoSql {
        /// The upstream gate name.
        gate_type: &'static str,
    },
    /// A source client could not be built.
    #[error("{what}: {source}")]
    Source {
        /// Which source.
        what: String,
        /// Why.
        #[source]
        source: SourceError,
    },
    /// A parameter that is optional in general is needed for this queue
    /// (e.g. `cost_per_request` when the queue counts tokens).
    #[error("gate `{gate_type}` needs `{param}`: {why}")]
    MissingParam {
        /// The gate name.
        gate_type: &'static str,
        /// The parameter.
        param: &'static str,
        /// Why this queue needs it.
        why: String,
    },
    /// A URL in the gate parameters does not parse (validated earlier, so
    /// only reachable when a spec is built by hand).
    #[error("invalid URL {url:?}")]
    Url {
        /// The URL as given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: url::ParseError,
    },
}

/// What gates need beyond their own parameters: connections, credentials
/// and timings from the rest of the configuration.
#[derive(Debug, Clone)]
pub struct GateContext {
    /// Prometheus connection, when configured.
    pub prometheus: Option<PrometheusConfig>,
    /// Redis credentials (`[redis]`), used by the `redis` gate.
    pub redis: Option<RedisConfig>,
    /// `[sql]`, for `sql-quota`.
    pub sql: Option<SqlConfig>,
    /// How long a source reading is reused (single-flight cache TTL).
    pub cache_ttl: Duration,
    /// Data older than this is no data.
    pub max_staleness: Duration,
    /// Bound on one query or scrape.
    pub source_timeout: Duration,
    /// The HTTP client for scrapes (one connection pool).
    pub http: reqwest::Client,
    /// Where metric sources read: the network, or in-process endpoints
    /// (`sluicegate eval` runs the same gates on the simulated pool).
    pub metrics: MetricsAccess,
    /// The queue's static capacity, against which a composite compares
    /// inner gates that have no live `max_SYS` of their own.
    pub capacity: Capacity,
    /// This process's name where a controller reads acknowledgements
    /// (`HOSTNAME`, the pod name on Kubernetes, else `sluicegate-<pid>`).
    pub replica: String,
    /// Seed of the gates' jitter (feedback windows, so replicas do not
    /// move in step): random per process in production, the scenario's
    /// seed in `sluicegate eval` so runs repeat exactly.
    pub seed: u64,
    /// Requests in flight in the queue's pool holding a
    /// `local-max-concurrency` slot: one counter per pool, so the gate caps
    /// the pool (every queue of it), not each queue alone. A fresh counter
    /// by default; `run` gives the queues of one pool the same one.
    pub pool_slots: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The queue's `worker_pool_id` (default `default`): the pool a
    /// `redis-leased-rate` lease must name unless its `pool_id` is set, as
    /// upstream takes the gate owner's worker pool.
    pub worker_pool_id: String,
    /// The task tree gates run background loops on (`redis-quota`'s lease
    /// renewal): `run` gives its own, so a panic there is named and stops
    /// the run. A tree of its own by default (probes, `eval`, tests).
    pub tasks: Tasks,
}

/// A queue's static `max_SYS` and the unit it counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// `max_sys` of the queue.
    pub max_sys: f64,
    /// What it counts.
    pub unit: Unit,
}

impl Capacity {
    /// The capacity an observation allows: its live `max_SYS` (which counts
    /// requests) in request units, else the static one.
    pub fn effective(&self, live: Option<f64>) -> f64 {
        match (live, self.unit) {
            (Some(live), Unit::Requests) => live,
            _ => self.max_sys,
        }
    }
}

impl Default for Capacity {
    /// A `[[queue]]`'s defaults.
    fn default() -> Self {
        Self {
            max_sys: 100.0,
            unit: Unit::Requests,
        }
    }
}

impl GateContext {
    /// A context with explicit timings.
    pub fn new(
        prometheus: Option<PrometheusConfig>,
        redis: Option<RedisConfig>,
        cache_ttl: Duration,
        max_staleness: Duration,
    ) -> Self {
        Self {
            prometheus,
            redis,
            sql: None,
            cache_ttl,
            max_staleness,
            source_timeout: max_staleness.min(Duration::from_secs(10)),
            http: reqwest::Client::new(),
            metrics: MetricsAccess::Network,
            capacity: Capacity::default(),
            replica: std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| format!("sluicegate-{}", std::process::id())),
            seed: rand::random(),
            pool_slots: std::sync::Arc::default(),
            worker_pool_id: "default".to_owned(),
            tasks: Tasks::new(),
        }
    }

    /// `source` behind the single-flight cache with this context's timings.
    pub(crate) fn cache<S: Source>(&self, source: S) -> Cached<S> {
        Cached::new(source, self.cache_ttl, self.max_staleness)
    }

    /// The Prometheus client, for a `gate_type` gate that needs one.
    pub(crate) fn prom_client(&self, gate_type: &'static str) -> Result<PromClient, BuildError> {
        if let MetricsAccess::InProcess(endpoint) = &self.metrics {
            return Ok(PromClient::in_process(endpoint.clone()));
        }
        let p = self
            .prometheus
            .as_ref()
            .ok_or(BuildError::NoPrometheus { gate_type })?;
        // `*_file` secrets were read into these when the config was loaded.
        let bearer = p.bearer_token.as_ref().map(|s| s.expose().to_owned());
        let password = p.basic_password.as_ref().map(|s| s.expose().to_owned());
        let auth = match (bearer, &p.basic_user) {
            (Some(token), _) => PromAuth::Bearer(token),
            (None, Some(user)) => PromAuth::Basic {
                user: user.clone(),
                password: password.unwrap_or_default(),
            },
            (None, None) => PromAuth::None,
        };
        PromClient::new(p.url.expose(), &auth, self.source_timeout).map_err(|source| {
            BuildError::Source {
                what: "prometheus".into(),
                source,
            }
        })
    }

    /// A cached scrape of `url`.
    pub(crate) fn scrape(&self, url: &str) -> Result<Cached<Scrape>, BuildError> {
        let parsed = url::Url::parse(url).map_err(|source| BuildError::Url {
            url: url.to_owned(),
            source,
        })?;
        let scrape = match &self.metrics {
            MetricsAccess::Network => Scrape::new(self.http.clone(), parsed, self.source_timeout),
            MetricsAccess::InProcess(endpoint) => Scrape::in_process(endpoint.clone(), parsed),
        };
        Ok(self.cache(scrape))
    }

    /// A cached scrape of each of `urls` (engine pages), in order.
    pub(crate) fn scrapes(&self, urls: &[String]) -> Result<Vec<Cached<Scrape>>, BuildError> {
        urls.iter().map(|u| self.scrape(u)).collect()
    }
}

impl GateContext {
    /// The Redis at `address` of a `gate_type` gate, with `[redis]`
    /// credentials.
    pub(crate) fn redis_endpoint(
        &self,
        gate_type: &str,
        address: &str,
    ) -> Result<RedisEndpoint, BuildError> {
        let (user, password) = match &self.redis {
            Some(r) => (
                r.username.clone(),
                r.password.as_ref().map(|s| s.expose().to_owned()),
            ),
            None => (None, None),
        };
        // `[redis] cluster = true`: every Redis this process talks to is a
        // cluster, the gates' as much as the transport's.
        let cluster = self.redis.as_ref().is_some_and(|r| r.cluster);
        let what = || format!("{gate_type} gate address {address}");
        let endpoint = RedisEndpoint::new(
            address,
            user.as_deref(),
            password.as_deref(),
            self.source_timeout,
            cluster,
        )
        .map_err(|source| BuildError::Source {
            what: what(),
            source,
        })?;
        // `[redis] mode = "sentinel"`: every Redis this process talks to is
        // a master behind the sentinels; the gate's address is the first
        // sentinel asked, then those of `[redis] addrs`.
        let Some(redis) = &self.redis else {
            return Ok(endpoint);
        };
        let master = crate::redis::sentinel_master(
            redis,
            Some(address),
            self.source_timeout,
            Some(self.source_timeout),
        )
        .map_err(|e| BuildError::Source {
            what: what(),
            source: SourceError::Redis(std::sync::Arc::new(e)),
        })?;
        Ok(match master {
            Some(master) => endpoint.behind_sentinel(master),
            None => endpoint,
        })
    }

    /// The budget key `key` at `address`, with `[redis]` credentials.
    pub(crate) fn redis_key(&self, address: &str, key: &str) -> Result<RedisKey, BuildError> {
        Ok(RedisKey::new(self.redis_endpoint("redis", address)?, key))
    }
}

/// Builds the gate described by `spec`.
pub fn build_gate(spec: &GateSpec, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
    spec.build(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx() -> GateContext {
        GateContext::new(None, None, Duration::from_secs(1), Duration::from_secs(10))
    }

    #[test]
    fn quota_and_tier_gates_build_nested_without_connecting() {
        // Redis is connected on first use: building needs no server.
        let quota = GateSpec::parse(
            "redis-quota",
            &json!({"address": "127.0.0.1:1", "limit": 5}),
            "q",
        )
        .expect("valid");
        let tier = GateSpec::parse(
            "tier-priority-admission",
            &json!({"saturation_gate": {"gate_type": "constant"}}),
            "q",
        )
        .expect("valid");
        let nested = GateSpec::parse(
            "composite",
            &json!({"gates": [quota.to_upstream(), tier.to_upstream()]}),
            "q",
        )
        .expect("valid");
        for spec in [&quota, &tier, &nested] {
            let gate = build_gate(spec, &ctx()).expect("builds");
            assert_eq!(gate.kind(), spec.upstream_name());
        }
    }

    #[test]
    fn prometheus_gates_need_prometheus() {
        let spec = GateSpec::parse("prometheus-budget", &json!({"pool": "p"}), "q").expect("valid");
        assert!(matches!(
            build_gate(&spec, &ctx()),
            Err(BuildError::NoPrometheus {
                gate_type: "prometheus-budget"
            })
        ));
    }
}
