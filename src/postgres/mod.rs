//! One PostgreSQL connection shared by the `sql` transport's queues and
//! the `sql-quota` gate, reconnected on demand: a server restart costs the
//! statements in flight (errors the callers retry), never the process.
//! On the ground floor beside `redis.rs`: the transport and the gate both
//! stand on it. `schema.rs` holds the tables (upstream's `sql` tables and
//! ours), created when a connection opens.
//!
//! Statements are prepared once per connection and cached by their text,
//! so a claim or an ack is one round trip. tokio-postgres pipelines the
//! statements of concurrent callers over the one connection; every
//! multi-step change is a single statement (CTEs), so no caller needs a
//! transaction of its own.

mod schema;
mod tls;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row, Statement};

use crate::secret::EndpointUrl;

pub(crate) use schema::partition_of;
pub use tls::{SqlTls, SslMode, TlsSetupError};

/// Why the database could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SqlError {
    /// No `[sql] url` (config loading reports this first; kept so opening
    /// stays total).
    #[error(
        "sql.url: required (a postgres:// or postgresql:// URL); set [sql] url, SLUICEGATE_SQL_URL or SQL_URL"
    )]
    MissingUrl,
    /// The URL is not one tokio-postgres understands.
    #[error("sql.url: {url}: {source}")]
    Url {
        /// The URL with its password masked.
        url: String,
        /// The parser's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server refused or could not be reached.
    #[error("sql.url: {url}: {op}: {source}")]
    Postgres {
        /// The URL with its password masked.
        url: String,
        /// What was being done (`connect`, `create schema`, ...).
        op: &'static str,
        /// PostgreSQL's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The TLS settings (`sql.sslmode`, `sql.tls_ca`, the URL's `sslmode`
    /// and `sslrootcert`) contradict each other or are not supported.
    #[error("{key}: {message}")]
    TlsConfig {
        /// `sql.sslmode` or `sql.tls_ca`.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// The TLS client could not be set up (the CA file).
    #[error(transparent)]
    TlsSetup(#[from] TlsSetupError),
    /// The TLS handshake failed: the certificate is not from the CA, is
    /// for another host name, or the server does not speak TLS.
    #[error("{tls}: {url}: TLS to the server failed: {reason}")]
    Tls {
        /// The settings in force (`sql.sslmode = …, sql.tls_ca = …`).
        tls: String,
        /// The URL with its password masked.
        url: String,
        /// What rustls refused (`invalid peer certificate: UnknownIssuer`).
        reason: String,
        /// The client's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server accepts only TLS connections and `sslmode` is `disable`.
    #[error(
        "sql.sslmode = disable: {url}: the server refuses connections without TLS ({server}); set sql.sslmode to require, verify-ca or verify-full"
    )]
    TlsRequired {
        /// The URL with its password masked.
        url: String,
        /// The server's message.
        server: String,
        /// The server's refusal.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The tables were written by an incompatible version of sluicegate.
    #[error(
        "sql.url: {url}: schema version {found} is not supported (this build reads {expected})"
    )]
    Schema {
        /// The URL with its password masked.
        url: String,
        /// Version found in `sluicegate_sql_meta`.
        found: String,
        /// Version this build writes.
        expected: u32,
    },
}

/// `[sql]`: the PostgreSQL database of the `sql` transport and the
/// `sql-quota` gate, on upstream's tables. `url` is required (or
/// upstream's `SQL_URL` variable). (Its keys, defaults and checks are
/// declared in `config/`, which assembles the sections.)
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SqlConfig {
    /// `postgres://` or `postgresql://` URL (a password in it is masked
    /// when shown); `SLUICEGATE_SQL_URL` or upstream's `SQL_URL`.
    pub url: Option<EndpointUrl>,
    /// Result route (`async_results.route`) for queues that set no
    /// `result_queue_name` (upstream's default `result-sql`).
    pub result_queue_name: String,
    /// How often an empty receive looks for new rows again (upstream's
    /// `poll_interval_ms`, default 1 s).
    #[serde(serialize_with = "crate::values::serialize_duration")]
    pub poll_interval: Duration,
    /// Most rows one claim statement leases (upstream's default 10).
    pub batch_size: usize,
    /// Lease of a claimed row, renewed while it is worked on (upstream's
    /// `lease_ttl_seconds`); unset: `dispatch.lease`. At least
    /// `dispatch.lease`.
    #[serde(serialize_with = "crate::values::serialize_optional_duration")]
    pub lease_ttl: Option<Duration>,
    /// Connect timeout of the database connection.
    #[serde(serialize_with = "crate::values::serialize_duration")]
    pub connect_timeout: Duration,
    /// How much TLS (libpq's `sslmode`); unset: the URL's `sslmode`, else
    /// `disable`.
    pub sslmode: Option<SslMode>,
    /// CA certificates (PEM) the server's certificate must chain to
    /// (libpq's `sslrootcert`); unset: the URL's, else the system's roots.
    pub tls_ca: Option<PathBuf>,
}

impl SqlConfig {
    /// The TLS keys, for [`Db::open`].
    pub fn tls_keys(&self) -> TlsKeys {
        TlsKeys {
            sslmode: self.sslmode,
            tls_ca: self.tls_ca.clone(),
        }
    }
}

/// `[sql] sslmode` and `tls_ca` as given (each may also come from the
/// URL's `sslmode` / `sslrootcert`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsKeys {
    /// `sql.sslmode`.
    pub sslmode: Option<SslMode>,
    /// `sql.tls_ca`.
    pub tls_ca: Option<PathBuf>,
}

impl TlsKeys {
    /// The TLS settings for `url`: these keys, else its parameters.
    pub fn resolve(&self, url: &url::Url) -> Result<SqlTls, SqlError> {
        let (_, from_url) = tls::split_url_tls(url);
        tls::resolve(self.sslmode, self.tls_ca.as_deref(), &from_url).map_err(|(key, message)| {
            SqlError::TlsConfig {
                key: format!("sql.{key}"),
                message,
            }
        })
    }
}

/// The server's message when `error` is it refusing a connection without
/// TLS (`pg_hba.conf` has only `hostssl` lines for us: "no encryption").
fn refuses_plain(error: &tokio_postgres::Error) -> Option<String> {
    let db = error.as_db_error()?;
    (*db.code() == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        && db.message().contains("no encryption"))
    .then(|| db.message().to_owned())
}

/// Whether the database records this build's schema script as run (a
/// database without `sluicegate_sql_meta` does not).
async fn schema_in_place(client: &Client) -> bool {
    let recorded = client
        .query_opt(
            "SELECT value FROM sluicegate_sql_meta WHERE key = $1",
            &[&schema::SCRIPT_KEY],
        )
        .await;
    matches!(recorded, Ok(Some(row)) if row.get::<_, String>(0) == schema::script_id())
}

/// Runs the schema script. Its DDL locks the queue tables, so while other
/// processes claim rows PostgreSQL may pick it as a deadlock's victim
/// (only when the schema changes: a first open, or a new build); it is
/// then run again, a few times.
async fn create_schema(client: &Client) -> Result<(), tokio_postgres::Error> {
    let script = schema::script();
    let mut tries = 0u32;
    loop {
        tries += 1;
        match client.batch_execute(&script).await {
            Err(e) if tries < 5 && e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED) => {
                tokio::time::sleep(Duration::from_millis(100) * tries).await;
            }
            done => return done,
        }
    }
}

struct Conn {
    client: Client,
    statements: Mutex<HashMap<&'static str, Statement>>,
}

/// A reconnecting connection to one database.
pub struct Db {
    config: tokio_postgres::Config,
    /// The TLS connector; `None` for `sslmode = disable`.
    tls: Option<tls::MakeRustls>,
    masked: String,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    reachable: AtomicBool,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db").field("url", &self.masked).finish()
    }
}

impl Db {
    /// Connects to `url` (a `postgres://` URL; its password never appears
    /// in errors or logs) with the TLS `keys` say (or its `sslmode` /
    /// `sslrootcert` parameters) and creates the schema if it is missing.
    pub async fn open(
        url: &EndpointUrl,
        keys: &TlsKeys,
        connect_timeout: Duration,
    ) -> Result<Arc<Self>, SqlError> {
        let masked = url.masked();
        let tls = keys.resolve(url.expose())?;
        // tokio-postgres parses neither `verify-*` nor `sslrootcert`.
        let (rest, _) = tls::split_url_tls(url.expose());
        let mut config: tokio_postgres::Config =
            rest.as_str().parse().map_err(|source| SqlError::Url {
                url: masked.clone(),
                source,
            })?;
        config.connect_timeout(connect_timeout);
        config.application_name("sluicegate");
        config.ssl_mode(match tls.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            _ => tokio_postgres::config::SslMode::Require,
        });
        let db = Arc::new(Self {
            config,
            tls: tls::connector(&tls)?,
            masked,
            conn: tokio::sync::Mutex::new(None),
            reachable: AtomicBool::new(false),
        });
        let conn = db.conn().await.map_err(|source| {
            let failure = (tls.mode != SslMode::Disable)
                .then(|| tls::tls_failure(&source))
                .flatten();
            if let Some(reason) = failure {
                SqlError::Tls {
                    tls: tls.describe(),
                    url: db.masked.clone(),
                    reason,
                    source,
                }
            } else if let Some(server) = refuses_plain(&source)
                && tls.mode == SslMode::Disable
            {
                SqlError::TlsRequired {
                    url: db.masked.clone(),
                    server,
                    source,
                }
            } else {
                db.error("connect", source)
            }
        })?;
        if !schema_in_place(&conn.client).await {
            create_schema(&conn.client)
                .await
                .map_err(|source| db.error("create schema", source))?;
        }
        let found: String = conn
            .client
            .query_one(
                "SELECT value FROM sluicegate_sql_meta WHERE key = 'schema_version'",
                &[],
            )
            .await
            .map_err(|source| db.error("read schema version", source))?
            .get(0);
        if found != schema::SCHEMA_VERSION.to_string() {
            return Err(SqlError::Schema {
                url: db.masked.clone(),
                found,
                expected: schema::SCHEMA_VERSION,
            });
        }
        Ok(db)
    }

    fn error(&self, op: &'static str, source: tokio_postgres::Error) -> SqlError {
        SqlError::Postgres {
            url: self.masked.clone(),
            op,
            source,
        }
    }

    /// The URL with its password masked, for logs.
    pub fn masked_url(&self) -> &str {
        &self.masked
    }

    /// Whether the last statement reached the server.
    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    async fn conn(&self) -> Result<Arc<Conn>, tokio_postgres::Error> {
        let mut slot = self.conn.lock().await;
        if let Some(conn) = slot.as_ref().filter(|c| !c.client.is_closed()) {
            return Ok(conn.clone());
        }
        *slot = None;
        let connected = match &self.tls {
            None => (self.config.connect(NoTls).await).map(|(c, conn)| (c, self.drive(conn))),
            Some(tls) => {
                (self.config.connect(tls.clone()).await).map(|(c, conn)| (c, self.drive(conn)))
            }
        };
        let client = match connected {
            Ok((client, ())) => client,
            Err(e) => {
                self.reachable.store(false, Ordering::Relaxed);
                return Err(e);
            }
        };
        let conn = Arc::new(Conn {
            client,
            statements: Mutex::new(HashMap::new()),
        });
        *slot = Some(conn.clone());
        self.reachable.store(true, Ordering::Relaxed);
        Ok(conn)
    }

    /// Runs `connection` (the socket's reader and writer) until it ends.
    fn drive<S, T>(&self, connection: tokio_postgres::Connection<S, T>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let url = self.masked.clone();
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::warn!(%url, %error, "postgresql connection closed; reconnecting on next use");
            }
        });
    }

    async fn statement(
        &self,
        conn: &Conn,
        sql: &'static str,
    ) -> Result<Statement, tokio_postgres::Error> {
        let cached = (conn.statements.lock())
            .unwrap_or_else(|p| p.into_inner())
            .get(sql)
            .cloned();
        if let Some(s) = cached {
            return Ok(s);
        }
        let s = conn.client.prepare(sql).await?;
        (conn.statements.lock())
            .unwrap_or_else(|p| p.into_inner())
            .insert(sql, s.clone());
        Ok(s)
    }

    fn note(&self, ok: bool) {
        self.reachable.store(ok, Ordering::Relaxed);
    }

    /// Runs `sql` (prepared once per connection) and returns its rows.
    pub async fn query(
        &self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let conn = self.conn().await?;
        let out = match self.statement(&conn, sql).await {
            Ok(s) => conn.client.query(&s, params).await,
            Err(e) => Err(e),
        };
        self.note(out.is_ok() || !conn.client.is_closed());
        out
    }

    /// Runs `sql` as one simple query, outside any transaction block
    /// (`VACUUM` needs that); not prepared.
    pub async fn batch_execute(&self, sql: &str) -> Result<(), tokio_postgres::Error> {
        let conn = self.conn().await?;
        let out = conn.client.batch_execute(sql).await;
        self.note(out.is_ok() || !conn.client.is_closed());
        out
    }

    /// Runs `sql` and returns how many rows it changed.
    pub async fn execute(
        &self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        let conn = self.conn().await?;
        let out = match self.statement(&conn, sql).await {
            Ok(s) => conn.client.execute(&s, params).await,
            Err(e) => Err(e),
        };
        self.note(out.is_ok() || !conn.client.is_closed());
        out
    }
}
