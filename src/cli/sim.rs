//! `sluicegate sim`: the simulator's flags over its config file, and the
//! real-time server they start.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use crate::sim::config::{LoadMode, SimConfig};
use crate::sim::error::SimError;
use crate::sim::spawn_http;

/// Background interactive load chosen on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum InteractiveArg {
    /// No background load.
    Off,
    /// Saturating bursts alternating with near-idle periods.
    Waves,
    /// Poisson with diurnal wave and bursts.
    Poisson,
    /// Replay of a CSV trace.
    Trace(PathBuf),
}

/// A `--interactive` value that is none of the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected off, waves, poisson or trace:FILE, got {0:?}")]
pub(super) struct InteractiveArgError(String);

impl FromStr for InteractiveArg {
    type Err = InteractiveArgError;

    fn from_str(s: &str) -> Result<Self, InteractiveArgError> {
        match s {
            "off" => Ok(Self::Off),
            "waves" => Ok(Self::Waves),
            "poisson" => Ok(Self::Poisson),
            _ => match s.strip_prefix("trace:") {
                Some(p) if !p.is_empty() => Ok(Self::Trace(PathBuf::from(p))),
                _ => Err(InteractiveArgError(s.to_owned())),
            },
        }
    }
}

/// `sluicegate sim serve` options; each overrides the config file.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on [default: the config's `listen`, else 127.0.0.1:8000].
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Simulator config file (TOML; unknown keys are errors).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Pool name, the `name` / `inference_pool` metric label [default: sim-pool].
    #[arg(long)]
    pub pool_name: Option<String>,
    /// Background interactive load: off, waves, poisson or trace:FILE.
    #[arg(long, value_parser = InteractiveArg::from_str)]
    pub interactive: Option<InteractiveArg>,
    /// Number of replicas.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Seed for all random draws.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Simulated seconds per real second (10 = the pool runs ten times faster).
    #[arg(long)]
    pub time_scale: Option<f64>,
}

impl ServeArgs {
    /// The config file (or defaults) with command-line overrides applied, validated.
    pub(super) fn into_config(self) -> Result<SimConfig, SimError> {
        let mut cfg = match &self.config {
            Some(path) => SimConfig::from_file(path)?,
            None => SimConfig::default(),
        };
        cfg.listen = Some(
            self.listen
                .or(cfg.listen)
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8000))),
        );
        if let Some(p) = self.pool_name {
            cfg.pool_name = p;
        }
        match self.interactive {
            None => {}
            Some(InteractiveArg::Off) => cfg.interactive.mode = LoadMode::Off,
            Some(InteractiveArg::Waves) => cfg.interactive.mode = LoadMode::Waves,
            Some(InteractiveArg::Poisson) => cfg.interactive.mode = LoadMode::Poisson,
            Some(InteractiveArg::Trace(p)) => {
                cfg.interactive.mode = LoadMode::Trace;
                cfg.interactive.trace_file = Some(p);
            }
        }
        if let Some(r) = self.replicas {
            cfg.replicas = r;
        }
        if let Some(s) = self.seed {
            cfg.seed = s;
        }
        if let Some(t) = self.time_scale {
            cfg.time_scale = t;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Runs the simulator front until `shutdown` resolves.
pub(super) async fn serve(
    args: ServeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    let cfg = args.into_config()?;
    let handle = spawn_http(cfg).await?;
    tracing::info!(addr = %handle.addr(), "simulator listening");
    shutdown.await;
    handle.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_interactive_arg() {
        assert_eq!("waves".parse::<InteractiveArg>(), Ok(InteractiveArg::Waves));
        assert_eq!(
            "trace:/x.csv".parse::<InteractiveArg>(),
            Ok(InteractiveArg::Trace("/x.csv".into()))
        );
        assert!("trace:".parse::<InteractiveArg>().is_err());
        assert!("busy".parse::<InteractiveArg>().is_err());
    }

    #[test]
    fn args_override_config() {
        let cfg = ServeArgs {
            pool_name: Some("p".into()),
            replicas: Some(3),
            interactive: Some(InteractiveArg::Poisson),
            ..Default::default()
        }
        .into_config()
        .unwrap();
        assert_eq!(cfg.pool_name, "p");
        assert_eq!(cfg.replicas, 3);
        assert_eq!(cfg.interactive.mode, LoadMode::Poisson);
        assert_eq!(cfg.listen, Some(SocketAddr::from(([127, 0, 0, 1], 8000))));
    }
}
