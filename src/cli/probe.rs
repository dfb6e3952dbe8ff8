//! `sluicegate gate probe`: evaluates a queue's gate once (or every
//! interval with `--watch`) against the live sources and explains the
//! budget: each source, its query or URL, the raw values, D, B, max_SYS, N
//! and why the gate is open or closed.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::{Value, json};
use tokio::time::Instant;

use std::path::PathBuf;

use super::EXIT_CONFIG;
use crate::config::{Config, ConfigError, ConfigSources, Overrides, QueueConfig, Rounding, Unit};
use crate::dispatch::window::headroom_units;
use crate::gate::{DispatchGate, Explanation, GateContext, Observation, build_gate};

/// Flags of `gate probe`: only those the probe uses are listed in its
/// help. The dispatcher flags it once shared with `run` are still
/// accepted (hidden) so existing scripts work; the probe needs neither a
/// transport nor a gateway.
#[derive(Debug, Args)]
pub(super) struct ProbeArgs {
    /// Config file (TOML); also `SLUICEGATE_CONFIG`.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The queue whose gate to probe (needed when several are configured).
    #[arg(long)]
    queue: Option<String>,
    /// Hidden: accepted for old scripts, not used by the probe.
    #[arg(long, hide = true)]
    transport: Option<String>,
    /// Hidden: accepted for old scripts, not used by the probe.
    #[arg(long, hide = true)]
    gateway_url: Option<String>,
    /// Hidden: accepted for old scripts, not used by the probe.
    #[arg(long, hide = true)]
    request_path: Option<String>,
    /// Hidden: accepted for old scripts, not used by the probe.
    #[arg(long, hide = true)]
    listen: Option<String>,
    /// Hidden: accepted for old scripts, not used by the probe.
    #[arg(long, hide = true)]
    log_format: Option<String>,
    /// Hidden: accepted for old scripts, not used by the probe.
    #[arg(long, hide = true)]
    log_level: Option<String>,
    /// Print JSON (one object per reading) instead of text.
    #[arg(long)]
    json: bool,
    /// Keep probing, one line per interval, until interrupted.
    #[arg(long)]
    watch: bool,
    /// Interval for `--watch` (e.g. `1s`, `500ms`); default: dispatch.poll_interval.
    #[arg(long)]
    interval: Option<String>,
}

/// One evaluated reading, everything `gate probe` prints.
struct Probe {
    queue: String,
    gate: &'static str,
    explanation: Explanation,
    observation: Observation,
    age: Duration,
    max_sys: f64,
    max_sys_live: bool,
    n: u64,
    unit: Unit,
    rounding: Rounding,
}

impl Probe {
    fn to_json(&self) -> Value {
        let o = &self.observation;
        json!({
            "queue": self.queue,
            "gate": self.gate,
            "budget": o.headroom(),
            "d": o.budget.get(),
            "baseline": o.baseline.get(),
            "max_sys": self.max_sys,
            "max_sys_source": if self.max_sys_live { "gate" } else { "queue.max_sys" },
            "n": self.n,
            "unit": self.unit.as_str(),
            "open": o.is_open() && self.n > 0,
            "source_available": o.source_available,
            "sees_own_load": o.sees_own_load,
            "counts_own_requests": o.counts_own_requests,
            "age_seconds": self.age.as_secs_f64(),
            "reason": o.reason,
            "sources": self.explanation.sources.iter().map(|s| json!({
                "role": s.role,
                "target": s.target,
                "values": s.values.iter().map(|(labels, value)| json!({"labels": labels, "value": value})).collect::<Vec<_>>(),
                "outcome": s.outcome,
            })).collect::<Vec<_>>(),
            "notes": self.explanation.notes,
        })
    }

    fn verdict(&self) -> String {
        let o = &self.observation;
        if !o.source_available && !o.is_open() {
            format!("CLOSED: source unavailable ({})", o.reason)
        } else if !o.is_open() {
            format!(
                "CLOSED: D {:.4} <= B {:.4} ({})",
                o.budget.get(),
                o.baseline.get(),
                o.reason
            )
        } else if self.n == 0 {
            format!(
                "CLOSED: N rounds to 0 ({:.4} × {}); consider rounding = \"at-least-one\"",
                o.headroom(),
                self.max_sys
            )
        } else {
            format!(
                "OPEN: D {:.4} > B {:.4} ({})",
                o.budget.get(),
                o.baseline.get(),
                o.reason
            )
        }
    }

    fn to_text(&self) -> String {
        let o = &self.observation;
        let mut out = format!("queue {}: gate {}\n", self.queue, self.gate);
        for (i, s) in self.explanation.sources.iter().enumerate() {
            out.push_str(&format!("  source {}: {}\n", i + 1, s.role));
            out.push_str(&format!("    query/url: {}\n", s.target));
            for (labels, value) in &s.values {
                out.push_str(&format!("    value:     {labels} {value}\n"));
            }
            out.push_str(&format!("    outcome:   {}\n", s.outcome));
        }
        for note in &self.explanation.notes {
            out.push_str(&format!("  note: {note}\n"));
        }
        out.push_str(&format!(
            "  D (budget):       {:.4}\n  B (baseline):     {:.4}\n  max_SYS:          {} {} ({})\n  N:                {} {} ({} of {} × ({:.4} − {:.4}))\n  data age:         {:.3} s\n  source available: {}\n  {}\n",
            o.budget.get(),
            o.baseline.get(),
            self.max_sys,
            self.unit.as_str(),
            if self.max_sys_live { "live from the gate" } else { "queue max_sys" },
            self.n,
            self.unit.as_str(),
            self.rounding.as_str(),
            self.max_sys,
            o.budget.get(),
            o.baseline.get(),
            self.age.as_secs_f64(),
            if o.source_available { "yes" } else { "no" },
            self.verdict(),
        ));
        out
    }

    fn to_line(&self) -> String {
        let o = &self.observation;
        format!(
            "{} D={:.4} B={:.4} max_SYS={} N={} open={} source_available={} age={:.2}s {}",
            httpdate::fmt_http_date(std::time::SystemTime::now()),
            o.budget.get(),
            o.baseline.get(),
            self.max_sys,
            self.n,
            o.is_open() && self.n > 0,
            o.source_available,
            self.age.as_secs_f64(),
            o.reason
        )
    }
}

async fn evaluate(gate: &dyn DispatchGate, queue: &QueueConfig, max_staleness: Duration) -> Probe {
    let explanation = gate.explain().await;
    let now = Instant::now();
    let mut observation = match &explanation.observation {
        Ok(o) => o.clone(),
        Err(e) => Observation::unavailable(now, e.to_string()),
    };
    let mut age = now.saturating_duration_since(observation.taken_at);
    // The same staleness rule the dispatcher applies.
    if age > max_staleness {
        observation = Observation::unavailable(
            now,
            format!(
                "observation is {} ms old, limit {} ms",
                age.as_millis(),
                max_staleness.as_millis()
            ),
        );
        age = Duration::ZERO;
    }
    let (max_sys, max_sys_live) = match observation.max_sys {
        Some(m) => (m, true),
        None => (queue.max_sys, false),
    };
    let n = headroom_units(max_sys, observation.headroom(), queue.rounding);
    Probe {
        queue: queue.queue_name.clone(),
        gate: gate.kind(),
        explanation,
        observation,
        age,
        max_sys,
        max_sys_live,
        n,
        unit: queue.unit,
        rounding: queue.rounding,
    }
}

/// Loads the configuration like `run`. The probe needs neither a transport
/// nor a gateway, so when those are the only errors it fills in
/// placeholders that it never uses.
fn load(args: &ProbeArgs) -> Result<Config, ExitCode> {
    let overrides = Overrides {
        transport: args.transport.clone(),
        gateway_url: args.gateway_url.clone(),
        request_path: args.request_path.clone(),
        // `--queue` selects the queue to probe; it does not rename one.
        queue: None,
        listen: args.listen.clone(),
        log_format: args.log_format.clone(),
        log_level: args.log_level.clone(),
    };
    let mut sources = ConfigSources::from_process(args.config.clone(), overrides);
    match Config::load(&sources) {
        Ok(c) => return Ok(c),
        Err(errors) => {
            let unused =
                |e: &&ConfigError| e.key == "transport" || e.key.ends_with(".igw_base_url");
            let needed: Vec<&ConfigError> = errors.errors().iter().filter(|e| !unused(e)).collect();
            if !needed.is_empty() {
                // Only what the probe needs: a missing transport or gateway
                // would be reported by `check-config`, not here.
                let text: Vec<String> = needed.iter().map(ToString::to_string).collect();
                eprintln!("configuration errors:\n{}", text.join("\n"));
                return Err(ExitCode::from(EXIT_CONFIG));
            }
        }
    }
    sources
        .env
        .entry("SLUICEGATE_TRANSPORT".into())
        .or_insert_with(|| "memory".into());
    sources
        .env
        .entry("SLUICEGATE_GATEWAY_URL".into())
        .or_insert_with(|| "http://127.0.0.1:9".into());
    Config::load(&sources).map_err(|errors| {
        eprintln!("configuration errors:\n{errors}");
        ExitCode::from(EXIT_CONFIG)
    })
}

/// Runs `gate probe`.
pub(super) async fn run(args: ProbeArgs) -> ExitCode {
    let config = match load(&args) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let queue = match &args.queue {
        Some(name) => config.queues.iter().find(|q| &q.queue_name == name),
        None if config.queues.len() == 1 => config.queues.first(),
        None => {
            let names: Vec<&str> = config
                .queues
                .iter()
                .map(|q| q.queue_name.as_str())
                .collect();
            eprintln!(
                "several queues are configured ({}); choose one with --queue",
                names.join(", ")
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let Some(queue) = queue else {
        eprintln!(
            "--queue: no queue named {:?}",
            args.queue.clone().unwrap_or_default()
        );
        return ExitCode::from(EXIT_CONFIG);
    };
    let interval = match &args.interval {
        None => config.dispatch.poll_interval,
        Some(text) => match crate::config::parse_duration(text) {
            Ok(d) if !d.is_zero() => d,
            _ => {
                eprintln!("--interval: expected a duration such as 1s or 500ms, got {text:?}");
                return ExitCode::from(EXIT_CONFIG);
            }
        },
    };
    let gate = match build_gate(
        &queue.gate,
        &GateContext::from_config(&config).for_queue(queue),
    ) {
        Ok(g) => g,
        Err(error) => {
            eprintln!("queue `{}`: {error}", queue.queue_name);
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let max_staleness = config.dispatch.max_staleness;
    if !args.watch {
        let probe = evaluate(gate.as_ref(), queue, max_staleness).await;
        if args.json {
            println!("{}", probe.to_json());
        } else {
            print!("{}", probe.to_text());
        }
        return ExitCode::SUCCESS;
    }
    let mut ticks = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
            _ = ticks.tick() => {}
        }
        let probe = evaluate(gate.as_ref(), queue, max_staleness).await;
        if args.json {
            println!("{}", probe.to_json());
        } else {
            println!("{}", probe.to_line());
        }
    }
}
