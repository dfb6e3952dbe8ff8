//! The crate's PostgreSQL (`sluicegate::servers::postgres`: a real server
//! on a free 127.0.0.1 port in a scratch data directory, stopped by PID)
//! with the tests' failures as panics, and a TLS-only variant.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A running (or stopped) PostgreSQL server; the rest of the crate's
/// (`url`, `pid`, `port`, `dir`, `log`, `stop`) through `Deref`.
#[derive(Debug)]
pub(crate) struct Postgres(sluicegate::servers::Postgres);

/// The certificates of a TLS-only server ([`Postgres::start_tls_only`]).
#[derive(Debug, Clone)]
pub(crate) struct PgTls {
    /// The CA that signed the server's certificate (for
    /// `subjectAltName = IP:127.0.0.1` only: `localhost` is another name).
    pub(crate) ca: PathBuf,
    /// A CA that signed nothing the server has.
    pub(crate) other_ca: PathBuf,
}

impl Postgres {
    /// `initdb` in a fresh directory, then starts the server and waits
    /// until it accepts connections.
    pub(crate) fn start() -> Self {
        Self(sluicegate::servers::Postgres::start().unwrap_or_else(|e| panic!("{e}")))
    }

    /// [`Self::start`] with `ssl = on` and a certificate from a private CA
    /// made with `openssl`, accepting TLS connections only.
    pub(crate) fn start_tls_only() -> (Self, PgTls) {
        let mut server =
            Self(sluicegate::servers::Postgres::init().unwrap_or_else(|e| panic!("{e}")));
        server.make_tls();
        let tls = server.0.dir().join("tls");
        server.0.set("ssl=on");
        server.0.set(&format!(
            "ssl_cert_file={}",
            tls.join("server.pem").display()
        ));
        server.0.set(&format!(
            "ssl_key_file={}",
            tls.join("server.key").display()
        ));
        server.0.run().unwrap_or_else(|e| panic!("{e}"));
        let certs = PgTls {
            ca: tls.join("ca.pem"),
            other_ca: tls.join("other-ca.pem"),
        };
        (server, certs)
    }

    /// Certificates in `<dir>/tls` (the server's for IP 127.0.0.1, signed
    /// by `ca.pem`; `other-ca.pem` unrelated) and a `pg_hba.conf` that
    /// takes TCP connections only over TLS.
    fn make_tls(&self) {
        let tls = self.0.dir().join("tls");
        std::fs::create_dir_all(&tls).expect("tls dir");
        let run = |args: &[&str]| {
            let ok = Command::new("openssl")
                .args(args)
                .current_dir(&tls)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("openssl runs")
                .success();
            assert!(ok, "openssl {args:?}");
        };
        for (key, pem, cn) in [
            ("ca.key", "ca.pem", "sluicegate-test-pg-ca"),
            ("other-ca.key", "other-ca.pem", "sluicegate-test-other-ca"),
        ] {
            run(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                key,
                "-out",
                pem,
                "-days",
                "2",
                "-subj",
                &format!("/CN={cn}"),
            ]);
        }
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ]);
        std::fs::write(tls.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").expect("ext");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ]);
        std::fs::write(
            self.0.data().join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .expect("pg_hba.conf");
        // The server reads its key only if its own user owns it, mode 0600.
        let hba = self.0.data().join("pg_hba.conf");
        self.0
            .give_to_postgres(&[&tls, &hba])
            .expect("chown the certificates to postgres");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            tls.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("key mode");
    }

    /// SIGKILLs the server (by PID), as a crash would, and waits until
    /// its backends are gone ([`sluicegate::servers::Postgres::kill`]).
    pub(crate) fn kill(&mut self) {
        self.0.kill().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts the server again on the same data directory and port.
    pub(crate) fn restart(&mut self) {
        self.0.restart().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Runs one SQL text with `psql` (for fixtures written as upstream's
    /// producer would) and returns its unaligned output.
    pub(crate) fn psql(&self, sql: &str) -> String {
        self.0.psql(sql).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl std::ops::Deref for Postgres {
    type Target = sluicegate::servers::Postgres;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Postgres {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}
