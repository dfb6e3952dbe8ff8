//! What `eval` compares: baselines and gates, each a name and how it
//! releases batch work.

use serde_json::{Value, json};

use super::endpoint::PAGE_URL;
use super::harness::Release;
use crate::config::GateSpec;

/// The pool name gates are configured with (the simulator's `name` /
/// `inference_pool` label).
pub const POOL: &str = "pool";

/// A gate of the user's own, as `--gate-spec` gives it (to `eval` and to
/// `eval --live`): `NAME={"gate_type": "...", "gate_params": {...}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedSpec {
    /// Its name in reports.
    pub name: String,
    /// The gate type.
    pub gate_type: String,
    /// Its parameters (an object; `{}` when absent).
    pub params: Value,
}

impl NamedSpec {
    /// Parses `NAME=JSON`.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let (name, text) = arg
            .split_once('=')
            .ok_or_else(|| format!("expected NAME=JSON, got `{arg}`"))?;
        let value: Value = serde_json::from_str(text).map_err(|e| format!("{name}: {e}"))?;
        let gate_type = value
            .get("gate_type")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{name}: `gate_type` (a string) is required"))?;
        let params = value
            .get("gate_params")
            .cloned()
            .unwrap_or_else(|| json!({}));
        if !params.is_object() {
            return Err(format!("{name}: `gate_params` must be an object"));
        }
        Ok(Self {
            name: name.to_owned(),
            gate_type: gate_type.to_owned(),
            params,
        })
    }
}

/// How a contender releases batch work.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// No gate: the whole backlog is released at once (flow control and
    /// 429s permitting).
    Ungated,
    /// A fixed static batch concurrency cap (`static-cap-N`).
    Cap(u32),
    /// The best static batch concurrency cap, found by grid search with
    /// the interactive outcome known in advance: an oracle no user has.
    StaticOracle,
    /// A catalogue gate, through the production window or upstream's
    /// per-poll release.
    Gate {
        /// The gate, as it would be configured.
        spec: Box<GateSpec>,
        /// Window or per-poll release.
        release: Release,
    },
}

/// One contender.
#[derive(Debug, Clone, PartialEq)]
pub struct Contender {
    /// Its name in reports and in `--gate`.
    pub name: String,
    /// What it does.
    pub kind: Kind,
}

impl Contender {
    /// A catalogue gate released through the window.
    pub fn gate(name: &str, gate_type: &str, params: &Value) -> Result<Self, String> {
        let spec = GateSpec::parse(gate_type, params, &format!("eval.{name}"))
            .map_err(|e| format!("{name}: {e}"))?;
        Ok(Self {
            name: name.to_owned(),
            kind: Kind::Gate {
                spec: Box::new(spec),
                release: Release::Window,
            },
        })
    }

    /// Whether this is a gate whose figures are sluicegate's own (not a
    /// baseline).
    pub fn is_gate(&self) -> bool {
        matches!(
            self.kind,
            Kind::Gate {
                release: Release::Window,
                ..
            }
        )
    }
}

/// The contender called `name` among `built_in`, or a fixed cap
/// `static-cap-N`.
pub fn find(built_in: &[Contender], name: &str) -> Option<Contender> {
    if let Some(cap) = name
        .strip_prefix("static-cap-")
        .and_then(|n| n.parse::<u32>().ok())
    {
        return Some(Contender {
            name: name.to_owned(),
            kind: Kind::Cap(cap),
        });
    }
    built_in.iter().find(|c| c.name == name).cloned()
}

/// The built-in contenders, baselines first. Gates run untuned: only the
/// parameters a user must give (the pool name, the metrics URL).
pub fn built_in() -> Result<Vec<Contender>, String> {
    let pool = json!({ "pool": POOL });
    let pages = json!({ "urls": [PAGE_URL] });
    let mut upstream = Contender::gate("upstream-per-poll", "prometheus-budget", &pool)?;
    if let Kind::Gate { release, .. } = &mut upstream.kind {
        *release = Release::PerPoll { batch_size: 10 };
    }
    Ok(vec![
        Contender {
            name: "ungated".to_owned(),
            kind: Kind::Ungated,
        },
        Contender {
            name: "static-cap-oracle".to_owned(),
            kind: Kind::StaticOracle,
        },
        upstream,
        Contender::gate("prometheus-budget", "prometheus-budget", &pool)?,
        Contender::gate("prometheus-saturation", "prometheus-saturation", &pool)?,
        Contender::gate("vllm", "vllm", &pages)?,
        Contender::gate("feedback", "feedback", &pages)?,
        Contender::gate("slo-headroom", "slo-headroom", &pages)?,
        Contender::gate(
            "feedback+slo-headroom",
            "feedback",
            &json!({ "urls": [PAGE_URL], "setpoint": {} }),
        )?,
    ])
}
