//! Redis connections: one client per process built from `[redis]`, a
//! multiplexed [`ConnectionManager`] (reconnects with backoff) for ordinary
//! commands, and dedicated connections without a response timeout for
//! blocking reads (the manager's timeout would cut `BRPOP` short).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, IntoConnectionInfo};

use crate::config::RedisConfig;

/// Why a Redis client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not a usable Redis URL.
    #[error("redis.url: {0}")]
    Url(#[source] redis::RedisError),
    /// Redis could not be reached.
    #[error("redis at {addr} is unreachable: {source}")]
    Unreachable {
        /// The address (password masked).
        addr: String,
        /// The connection error.
        #[source]
        source: redis::RedisError,
    },
}

/// How long a pipelined batch may take before the manager reconnects.
/// Generous: one batch settles up to 512 messages.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Builds the client for `config`: URL (`redis://`, `rediss://`, database
/// number in the path), then username and password from the config, the
/// password file or the URL, in that order.
pub fn client(config: &RedisConfig) -> Result<Client, ConnectError> {
    let mut info = config
        .url
        .expose()
        .as_str()
        .into_connection_info()
        .map_err(ConnectError::Url)?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = config.username.as_deref().filter(|u| !u.is_empty()) {
        settings = settings.set_username(user);
    }
    // A `password_file` was read into `password` when the config (or the
    // command's flags) were loaded.
    if let Some(password) = &config.password {
        settings = settings.set_password(password.expose());
    }
    info = info.set_redis_settings(settings);
    Client::open(info).map_err(ConnectError::Url)
}

/// A connection manager that connects lazily and reconnects with
/// exponential backoff; commands fail fast while Redis is down.
pub fn manager(client: &Client) -> Result<ConnectionManager, ConnectError> {
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(100))
        .set_max_delay(Duration::from_secs(2));
    ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(ConnectError::Url)
}

/// A dedicated connection without response timeout, for blocking commands.
pub async fn blocking(client: &Client) -> Result<MultiplexedConnection, ConnectError> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(None);
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|source| ConnectError::Unreachable {
            addr: masked_addr(client),
            source,
        })
}

/// The client's address for messages, without credentials.
pub fn masked_addr(client: &Client) -> String {
    client.get_connection_info().addr().to_string()
}
