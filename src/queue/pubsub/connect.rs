//! The Pub/Sub client from `[pubsub]`: the emulator with anonymous
//! credentials when `emulator_host` or `PUBSUB_EMULATOR_HOST` names one,
//! else a service-account key file, else application default credentials.

use gcloud_gax::conn::{ConnectionOptions, Environment};
use gcloud_pubsub::client::google_cloud_auth::credentials::CredentialsFile;
use gcloud_pubsub::client::{Client, ClientConfig};
use std::time::Duration;

use super::PubSubError;
use crate::config::PubSubConfig;

/// The standard variable Google's tools read for the emulator address.
pub const EMULATOR_ENV: &str = "PUBSUB_EMULATOR_HOST";
/// How long opening a gRPC connection may take before startup fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Keepalive pings find a dead connection (an emulator or a proxy that
/// went away) in seconds rather than at the next RPC's own timeout.
const KEEPALIVE: Duration = Duration::from_secs(10);

/// Where the client connects, decided before any I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The emulator at `host:port`, anonymous.
    Emulator(String),
    /// Google Cloud with this key file.
    KeyFile(String),
    /// Google Cloud with application default credentials.
    DefaultCredentials,
}

/// `[pubsub] emulator_host` wins over `PUBSUB_EMULATOR_HOST`; either wins
/// over credentials (an emulator takes none).
pub fn target(config: &PubSubConfig, env_emulator: Option<String>) -> Target {
    match (
        config.emulator_host.clone(),
        env_emulator.filter(|h| !h.is_empty()),
    ) {
        (Some(host), _) | (None, Some(host)) => Target::Emulator(host),
        (None, None) => match &config.credentials_file {
            Some(path) => Target::KeyFile(path.display().to_string()),
            None => Target::DefaultCredentials,
        },
    }
}

/// Connects a client for `project_id` per `config` and the environment.
pub async fn connect(config: &PubSubConfig) -> Result<Client, PubSubError> {
    connect_to(
        &config.project_id,
        target(config, std::env::var(EMULATOR_ENV).ok()),
    )
    .await
}

/// Connects a client for `project_id` to `target`.
pub async fn connect_to(project_id: &str, target: Target) -> Result<Client, PubSubError> {
    let mut cc = ClientConfig {
        project_id: Some(project_id.to_owned()),
        connection_option: ConnectionOptions {
            connect_timeout: Some(CONNECT_TIMEOUT),
            http2_keep_alive_interval: Some(KEEPALIVE),
            keep_alive_timeout: Some(KEEPALIVE),
            keep_alive_while_idle: Some(true),
            ..ConnectionOptions::default()
        },
        ..ClientConfig::default()
    };
    let described = match &target {
        Target::Emulator(host) => format!("the emulator at {host}"),
        Target::KeyFile(path) => format!("Google Cloud (key file {path})"),
        Target::DefaultCredentials => "Google Cloud (application default credentials)".to_owned(),
    };
    cc = match target {
        Target::Emulator(host) => {
            cc.environment = Environment::Emulator(host);
            cc
        }
        Target::KeyFile(path) => {
            let file = CredentialsFile::new_from_file(path)
                .await
                .map_err(PubSubError::Auth)?;
            cc.with_credentials(file).await.map_err(PubSubError::Auth)?
        }
        Target::DefaultCredentials => cc.with_auth().await.map_err(PubSubError::Auth)?,
    };
    Client::new(cc).await.map_err(|source| PubSubError::Client {
        target: described,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(emulator: Option<&str>, key: Option<&str>) -> PubSubConfig {
        PubSubConfig {
            project_id: "p".into(),
            result_topic_id: Some("r".into()),
            emulator_host: emulator.map(str::to_owned),
            credentials_file: key.map(Into::into),
            ..PubSubConfig::default()
        }
    }

    #[test]
    fn the_emulator_wins_and_config_beats_the_environment() {
        let env = || Some("127.0.0.1:2".to_owned());
        assert_eq!(
            target(&config(Some("127.0.0.1:1"), Some("k.json")), env()),
            Target::Emulator("127.0.0.1:1".into())
        );
        assert_eq!(
            target(&config(None, Some("k.json")), env()),
            Target::Emulator("127.0.0.1:2".into())
        );
        assert_eq!(
            target(&config(None, Some("k.json")), Some(String::new())),
            Target::KeyFile("k.json".into())
        );
        assert_eq!(
            target(&config(None, None), None),
            Target::DefaultCredentials
        );
    }
}
