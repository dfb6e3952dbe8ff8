//! A value written to a Redis key by an external controller.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::{Source, SourceError, Timestamped};

/// A [`Source`] reading one string key; `None` when the key is missing.
pub struct RedisKey {
    client: redis::Client,
    /// Address for messages (no credentials).
    shown: String,
    key: String,
    timeout: Duration,
    /// Connected on first use, so a Redis that is down at startup only
    /// closes the gate instead of failing the process.
    connection: OnceCell<ConnectionManager>,
}

impl std::fmt::Debug for RedisKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisKey")
            .field("address", &self.shown)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl RedisKey {
    /// Reads `key` at `address` (`host:port` or a `redis://` / `rediss://`
    /// URL), authenticating with `username` / `password` when given.
    pub fn new(
        address: &str,
        username: Option<&str>,
        password: Option<&str>,
        key: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, SourceError> {
        let url = if address.contains("://") {
            address.to_owned()
        } else {
            format!("redis://{address}")
        };
        let shown = url::Url::parse(&url)
            .map(|u| crate::config::mask_url(&u))
            .unwrap_or_else(|_| address.to_owned());
        let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
            .map_err(|e| SourceError::Redis(Arc::new(e)))?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = username {
            settings = settings.set_username(user);
        }
        if let Some(password) = password {
            settings = settings.set_password(password);
        }
        let client = redis::Client::open(info.set_redis_settings(settings))
            .map_err(|e| SourceError::Redis(Arc::new(e)))?;
        Ok(Self {
            client,
            shown,
            key: key.into(),
            timeout,
            connection: OnceCell::new(),
        })
    }

    /// `GET <key> at <address>`, without credentials.
    pub fn describe_key(&self) -> String {
        format!("GET {} at {}", self.key, self.shown)
    }

    async fn read(&self) -> Result<Timestamped<Option<String>>, SourceError> {
        let taken_at = Instant::now();
        let work = async {
            let manager = self
                .connection
                .get_or_try_init(|| {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout))
                        .set_number_of_retries(1);
                    self.client.get_connection_manager_with_config(config)
                })
                .await
                .map_err(|e| SourceError::Redis(Arc::new(e)))?;
            let mut conn = manager.clone();
            let value: Option<String> = conn
                .get(&self.key)
                .await
                .map_err(|e| SourceError::Redis(Arc::new(e)))?;
            Ok(value)
        };
        let value = tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| SourceError::Timeout(self.timeout))??;
        Ok(Timestamped { value, taken_at })
    }
}

impl Source for RedisKey {
    type Output = Option<String>;

    fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<Option<String>>, SourceError>> {
        Box::pin(self.read())
    }

    fn describe(&self) -> String {
        self.describe_key()
    }
}
