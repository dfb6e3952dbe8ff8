//! A Redis master found through Redis Sentinel, followed across
//! failovers.
//!
//! The `ConnectionManager` cannot do this: it reconnects to the address
//! its client was built with, so after a failover it would keep dialling
//! the old master (or, once that is demoted, write into a read-only
//! replica). [`SentinelConnection`] holds one multiplexed connection to
//! the master the sentinels name, and drops it when an answer says the
//! master is gone: the connection broke or timed out (a killed master, or
//! the `CLIENT KILL` Sentinel sends the old master when it demotes it), or
//! the server answers `READONLY` / `MASTERDOWN` (it is a replica now). The
//! next command asks the sentinels again. Like the manager, it never
//! retries a command itself: the caller gets the error (the transport and
//! the gates already treat a Redis error as "try again later"), so a
//! command is never run twice behind the caller's back.
//!
//! While the master cannot be reached, resolution is retried with
//! exponential backoff and commands in between fail fast with the last
//! error, as the manager's do.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Value};
use tokio::time::Instant;

/// First pause after a failed resolution; doubled per failure.
const MIN_RETRY_DELAY: Duration = Duration::from_millis(100);
/// Longest pause between resolutions (as the manager's `max_delay`).
const MAX_RETRY_DELAY: Duration = Duration::from_secs(2);

/// How long to wait before resolving again after `failures` failed
/// resolutions in a row: 100 ms, doubled each time, at most 2 s.
pub(super) fn retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (MIN_RETRY_DELAY * 2u32.pow(doublings)).min(MAX_RETRY_DELAY)
}

/// Whether `error` means the connection no longer leads to the master, so
/// the sentinels must be asked again: the connection broke or timed out,
/// or the node says it is not (or no longer) a writable master.
pub(super) fn loses_master(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_unrecoverable_error()
        || matches!(
            error.kind(),
            ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                | ErrorKind::Server(redis::ServerErrorKind::MasterDown)
        )
}

/// The connection to the master the sentinels name, shared by clones.
#[derive(Clone)]
pub struct SentinelConnection {
    shared: Arc<Shared>,
}

struct Shared {
    /// Asks the sentinels (it caches its sentinel connections); one
    /// resolution at a time, so a failover costs one lookup, not one per
    /// waiting command.
    resolver: tokio::sync::Mutex<SentinelClient>,
    state: Mutex<State>,
    /// Timeouts of the master connection.
    connection: AsyncConnectionConfig,
    /// Bound on one resolution (sentinel lookup, role check, connect).
    resolve_timeout: Duration,
    /// The database selected on the master.
    db: i64,
    /// The master's name, for messages.
    master_name: String,
}

#[derive(Default)]
struct State {
    /// The connection to the master and its number (a lost one is only
    /// forgotten if it is still the current one).
    current: Option<(u64, MultiplexedConnection)>,
    /// Connections made so far.
    made: u64,
    /// Failed resolutions since the last success.
    failures: u32,
    /// No resolution before this; commands fail with `last_error`.
    retry_at: Option<Instant>,
    last_error: Option<RedisError>,
}

impl SentinelConnection {
    /// A connection that resolves `master_name` through `resolver` on its
    /// first command (lazily, as the other connections: an unreachable
    /// Redis is an error of the first command, not of start-up).
    pub(super) fn new(
        resolver: SentinelClient,
        master_name: &str,
        db: i64,
        connect_timeout: Duration,
        response_timeout: Option<Duration>,
    ) -> Self {
        let connection = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(response_timeout);
        Self {
            shared: Arc::new(Shared {
                resolver: tokio::sync::Mutex::new(resolver),
                state: Mutex::new(State::default()),
                connection,
                // A lookup asks the sentinels, then checks the master's
                // role and connects: a few round trips, each bounded by
                // the connect timeout on a healthy network.
                resolve_timeout: connect_timeout * 3,
                db,
                master_name: master_name.to_owned(),
            }),
        }
    }

    /// The current master connection, resolving one when there is none.
    async fn current(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        if let Some(current) = self.shared.ready()? {
            return Ok(current);
        }
        let mut resolver = self.shared.resolver.lock().await;
        // Another command may have resolved (or failed to) while this one
        // waited for the resolver.
        if let Some(current) = self.shared.ready()? {
            return Ok(current);
        }
        let attempt = tokio::time::timeout(self.shared.resolve_timeout, async {
            let client = resolver.async_get_client().await?;
            client
                .get_multiplexed_async_connection_with_config(&self.shared.connection)
                .await
        })
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from((
                ErrorKind::Io,
                "sentinel lookup timed out",
                format!(
                    "no master `{}` within {:?}",
                    self.shared.master_name, self.shared.resolve_timeout
                ),
            )))
        });
        let mut state = self.shared.state();
        match attempt {
            Ok(conn) => {
                state.made += 1;
                state.failures = 0;
                state.retry_at = None;
                state.last_error = None;
                state.current = Some((state.made, conn.clone()));
                tracing::info!(master = %self.shared.master_name, "redis master resolved through sentinel");
                Ok((state.made, conn))
            }
            Err(error) => {
                state.failures = state.failures.saturating_add(1);
                state.retry_at = Some(Instant::now() + retry_delay(state.failures));
                state.last_error = Some(error.clone());
                Err(error)
            }
        }
    }

    /// Forgets connection `number` if `result` says it lost the master.
    fn observe<T>(&self, number: u64, result: &Result<T, RedisError>) {
        if let Err(error) = result
            && loses_master(error)
        {
            let mut state = self.shared.state();
            if state.current.as_ref().is_some_and(|(n, _)| *n == number) {
                tracing::warn!(master = %self.shared.master_name, %error, "redis master lost; asking the sentinels again");
                state.current = None;
            }
        }
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding it leaves plain data behind: still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection if there is one; `None` when a resolution may run
    /// now; the last error while the backoff lasts.
    fn ready(&self) -> Result<Option<(u64, MultiplexedConnection)>, RedisError> {
        let state = self.state();
        if let Some(current) = &state.current {
            return Ok(Some(current.clone()));
        }
        match (&state.retry_at, &state.last_error) {
            (Some(at), Some(error)) if Instant::now() < *at => Err(error.clone()),
            _ => Ok(None),
        }
    }
}

impl fmt::Debug for SentinelConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelConnection")
            .field("master_name", &self.shared.master_name)
            .finish_non_exhaustive()
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (number, mut conn) = self.current().await?;
            let result = conn.req_packed_command(cmd).await;
            self.observe(number, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (number, mut conn) = self.current().await?;
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            self.observe(number, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolution_backs_off_from_100ms_doubling_to_2s() {
        let delays: Vec<_> = (1..=7).map(retry_delay).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            delays,
            [
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(2000),
                ms(2000)
            ]
        );
        // No overflow however long the master stays away.
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY_DELAY);
    }

    #[test]
    fn broken_connections_and_demoted_masters_are_lost_masters() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(loses_master(&io));
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(loses_master(&timeout));
        let readonly = RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "You can't write against a read only replica.",
        ));
        assert!(loses_master(&readonly));
        // A script's own error or a wrong type says nothing about the
        // master: the connection is kept.
        let script = RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "ERR user script error",
        ));
        assert!(!loses_master(&script));
        let typed = RedisError::from((ErrorKind::UnexpectedReturnType, "not a number"));
        assert!(!loses_master(&typed));
    }
}
