//! TLS to PostgreSQL (`[sql] sslmode`, `[sql] tls_ca`) against a real
//! server started with `ssl = on`, a certificate from a CA the test makes
//! (for IP 127.0.0.1 only) and a `pg_hba.conf` that takes TCP connections
//! only over TLS: `require` and `verify-full` with the right CA connect
//! (and the session is encrypted, by the server's own `pg_stat_ssl`); a
//! wrong CA or host name is refused naming the keys; `disable` is refused
//! by the server, the error saying which key to change.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use sluicegate::config::{Config, EndpointUrl, SslMode};
use sluicegate::postgres::{Db, SqlError, TlsKeys};

use crate::support::postgres::Postgres;

const TIMEOUT: Duration = Duration::from_secs(5);

fn url(text: &str) -> EndpointUrl {
    EndpointUrl::new(url::Url::parse(text).expect("url"))
}

fn keys(mode: SslMode, ca: Option<&Path>) -> TlsKeys {
    TlsKeys {
        sslmode: Some(mode),
        tls_ca: ca.map(Path::to_path_buf),
    }
}

/// Whether the server sees this session as TLS (`pg_stat_ssl`).
async fn encrypted(db: &Db) -> bool {
    let rows = db
        .query(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_ssl");
    rows.first().is_some_and(|r| r.get::<_, bool>(0))
}

async fn open_err(url_text: &str, keys: &TlsKeys) -> String {
    match Db::open(&url(url_text), keys, TIMEOUT).await {
        Ok(_) => panic!("{url_text} with {keys:?} connected"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_modes_against_a_tls_only_server() {
    let (pg, tls) = Postgres::start_tls_only();
    let by_ip = pg.url();
    // The same server under a name its certificate does not carry.
    let by_name = by_ip.replace("127.0.0.1", "localhost");

    // `require`: encrypted, the certificate not checked.
    let db = Db::open(&url(&by_ip), &keys(SslMode::Require, None), TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("require: {e}"));
    assert!(encrypted(&db).await, "require gave a plain session");

    // `verify-full` with the CA that signed the server's certificate.
    let db = Db::open(
        &url(&by_ip),
        &keys(SslMode::VerifyFull, Some(&tls.ca)),
        TIMEOUT,
    )
    .await
    .unwrap_or_else(|e| panic!("verify-full: {e}"));
    assert!(encrypted(&db).await);

    // `verify-full` with a CA that signed nothing of the server's.
    let err = open_err(&by_ip, &keys(SslMode::VerifyFull, Some(&tls.other_ca))).await;
    assert!(
        err.starts_with(&format!(
            "sql.sslmode = verify-full, sql.tls_ca = {}:",
            tls.other_ca.display()
        )),
        "{err}"
    );
    assert!(err.contains("TLS to the server failed"), "{err}");
    assert!(err.contains("UnknownIssuer"), "{err}");

    // `verify-full` by a host name the certificate is not for.
    let err = open_err(&by_name, &keys(SslMode::VerifyFull, Some(&tls.ca))).await;
    assert!(err.starts_with("sql.sslmode = verify-full"), "{err}");
    assert!(
        err.contains("certificate not valid for name \"localhost\""),
        "{err}"
    );
    // `verify-ca` checks the chain only: the same name is accepted, a
    // wrong CA is not.
    let db = Db::open(
        &url(&by_name),
        &keys(SslMode::VerifyCa, Some(&tls.ca)),
        TIMEOUT,
    )
    .await
    .unwrap_or_else(|e| panic!("verify-ca by name: {e}"));
    assert!(encrypted(&db).await);
    let err = open_err(&by_name, &keys(SslMode::VerifyCa, Some(&tls.other_ca))).await;
    assert!(err.starts_with("sql.sslmode = verify-ca"), "{err}");

    // `disable` against a TLS-only server: the server refuses, the error
    // names the key to change.
    let err = open_err(&by_ip, &keys(SslMode::Disable, None)).await;
    assert!(
        err.starts_with("sql.sslmode = disable:")
            && err.contains("refuses connections without TLS")
            && err.contains("set sql.sslmode to require, verify-ca or verify-full"),
        "{err}"
    );
    assert!(err.contains("no encryption"), "{err}");

    // libpq's URL parameters work as the keys do (upstream's URLs carry
    // them), and a key contradicting one is an error naming the key.
    let with_params = format!(
        "{by_ip}?sslmode=verify-full&sslrootcert={}",
        tls.ca.display()
    );
    let db = Db::open(&url(&with_params), &TlsKeys::default(), TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("URL parameters: {e}"));
    assert!(encrypted(&db).await);
    match Db::open(&url(&with_params), &keys(SslMode::Require, None), TIMEOUT).await {
        Err(SqlError::TlsConfig { key, message }) => {
            assert_eq!(key, "sql.sslmode");
            assert!(
                message.contains("contradicts the URL's sslmode=verify-full"),
                "{message}"
            );
        }
        other => panic!("expected a TLS config error, got {other:?}"),
    }

    // A CA file that is not one: named, at start.
    let bogus = pg.dir().join("not-a-ca.pem");
    std::fs::write(&bogus, "hello").expect("write");
    let err = open_err(&by_ip, &keys(SslMode::VerifyFull, Some(&bogus))).await;
    assert!(
        err.starts_with(&format!("sql.tls_ca: {}: no certificate", bogus.display())),
        "{err}"
    );
}

/// The keys as a deployment sets them: the environment
/// (`SLUICEGATE_SQL_SSLMODE`, `SLUICEGATE_SQL_TLS_CA`) into `[sql]`, then
/// the connection the `sql` transport opens from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_keys_reach_the_connection() {
    let (pg, tls) = Postgres::start_tls_only();
    let ca = tls.ca.display().to_string();
    let env: BTreeMap<String, String> = [
        ("SLUICEGATE_TRANSPORT", "sql"),
        ("SLUICEGATE_SQL_URL", pg.url().as_str()),
        ("SLUICEGATE_SQL_SSLMODE", "verify-full"),
        ("SLUICEGATE_SQL_TLS_CA", ca.as_str()),
        ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:9"),
        ("SLUICEGATE_GATE_TYPE", "constant"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let config = Config::load(&sluicegate::config::ConfigSources {
        env,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let sql = config.sql.expect("[sql]");
    assert_eq!(sql.sslmode, Some(SslMode::VerifyFull));
    let db = Db::open(
        sql.url.as_ref().expect("url"),
        &sql.tls_keys(),
        sql.connect_timeout,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(encrypted(&db).await);

    // Bad values are refused when the config loads, naming the key and
    // the allowed values.
    let err = Config::from_toml_str(
        &format!(
            "transport = \"sql\"\n[sql]\nurl = \"{}\"\nsslmode = \"prefer\"\n[gateway]\nurl = \"http://127.0.0.1:9\"\n[[queue]]\nqueue_name = \"q\"\ngate_type = \"constant\"\n",
            pg.url()
        ),
        &BTreeMap::new(),
    )
    .expect_err("prefer is not offered");
    let text = err.to_string();
    assert!(
        text.contains("sql.sslmode: unknown value \"prefer\"; allowed: disable, require, verify-ca, verify-full"),
        "{text}"
    );
    let err = Config::from_toml_str(
        &format!(
            "transport = \"sql\"\n[sql]\nurl = \"{}?sslmode=require\"\nsslmode = \"verify-full\"\n[gateway]\nurl = \"http://127.0.0.1:9\"\n[[queue]]\nqueue_name = \"q\"\ngate_type = \"constant\"\n",
            pg.url()
        ),
        &BTreeMap::new(),
    )
    .expect_err("contradiction");
    assert!(
        err.to_string()
            .contains("sql.sslmode: verify-full contradicts the URL's sslmode=require"),
        "{err}"
    );
}
