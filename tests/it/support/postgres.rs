//! A real PostgreSQL server on a free 127.0.0.1 port, in a temporary data
//! directory made by `initdb`, run as the `postgres` binary directly so
//! its PID is ours to stop (on drop too). Never the machine-wide server.
//!
//! PostgreSQL refuses to run as root: when the tests run as root (CI), the
//! directory is handed to the `postgres` user and `initdb` / `postgres`
//! run through `setpriv`, which execs, so the PID stays the server's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) use super::free_port;

/// A running (or stopped) PostgreSQL server.
#[derive(Debug)]
pub(crate) struct Postgres {
    child: Option<Child>,
    /// Its port.
    pub(crate) port: u16,
    dir: PathBuf,
    bindir: PathBuf,
    as_postgres: bool,
    /// TLS only (`ssl = on`, `hostssl` lines alone in `pg_hba.conf`).
    tls: bool,
}

/// The certificates of a TLS-only server ([`Postgres::start_tls_only`]).
#[derive(Debug, Clone)]
pub(crate) struct PgTls {
    /// The CA that signed the server's certificate (for
    /// `subjectAltName = IP:127.0.0.1` only: `localhost` is another name).
    pub(crate) ca: PathBuf,
    /// A CA that signed nothing the server has.
    pub(crate) other_ca: PathBuf,
}

/// The directory holding `initdb` and `postgres`: `pg_config --bindir`,
/// else the newest `/usr/lib/postgresql/*/bin`.
fn bindir() -> PathBuf {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|d| d.join("initdb").is_file() && d.join("postgres").is_file());
    if let Some(dir) = from_pg_config {
        return dir;
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .filter(|b| b.join("initdb").is_file() && b.join("postgres").is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().expect(
        "PostgreSQL server binaries (initdb, postgres): install Debian's `postgresql` package",
    )
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Postgres {
    /// `initdb` in a fresh directory, then starts the server and waits
    /// until it accepts connections.
    pub(crate) fn start() -> Self {
        Self::start_with(false)
    }

    /// [`Self::start`] with `ssl = on` and a certificate from a private CA
    /// made with `openssl`, accepting TLS connections only.
    pub(crate) fn start_tls_only() -> (Self, PgTls) {
        let server = Self::start_with(true);
        let tls = PgTls {
            ca: server.dir.join("tls/ca.pem"),
            other_ca: server.dir.join("tls/other-ca.pem"),
        };
        (server, tls)
    }

    fn start_with(tls: bool) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("sluicegate-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("postgres dir");
        let as_postgres = is_root();
        if as_postgres {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("chown runs")
                .success();
            assert!(ok, "chown the data directory to postgres");
        }
        let mut server = Self {
            child: None,
            port,
            dir,
            bindir: bindir(),
            as_postgres,
            tls,
        };
        let data = server.data();
        let out = server
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .output()
            .expect("initdb runs");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if tls {
            server.make_tls();
        }
        server.spawn();
        server
    }

    /// Certificates in `<dir>/tls` (the server's for IP 127.0.0.1, signed
    /// by `ca.pem`; `other-ca.pem` unrelated) and a `pg_hba.conf` that
    /// takes TCP connections only over TLS.
    fn make_tls(&self) {
        let tls = self.dir.join("tls");
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
            self.data().join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .expect("pg_hba.conf");
        // The server reads its key only if its own user owns it, mode 0600.
        if self.as_postgres {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&tls)
                .arg(self.data().join("pg_hba.conf"))
                .status()
                .expect("chown runs")
                .success();
            assert!(ok, "chown the certificates to postgres");
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            tls.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("key mode");
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// `bin` of the server's version, run as `postgres` when we are root.
    fn command(&self, bin: &str) -> Command {
        let path = self.bindir.join(bin);
        if self.as_postgres {
            let mut cmd = Command::new("setpriv");
            cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
                .arg(path);
            cmd
        } else {
            Command::new(path)
        }
    }

    /// The connection URL (trust auth, user `postgres`).
    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's PID, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.join("server.log")).expect("log file");
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=50",
            ])
            .args(if self.tls {
                let tls = self.dir.join("tls");
                vec![
                    "-c".to_owned(),
                    "ssl=on".to_owned(),
                    "-c".to_owned(),
                    format!("ssl_cert_file={}", tls.join("server.pem").display()),
                    "-c".to_owned(),
                    format!("ssl_key_file={}", tls.join("server.key").display()),
                ]
            } else {
                Vec::new()
            })
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres starts");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("postgres exited at start ({status}): {}", self.log());
            }
            let ready = Command::new(self.bindir.join("pg_isready"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            assert!(
                Instant::now() < give_up,
                "postgres not ready: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server log so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Stops the server by PID: SIGINT (PostgreSQL's fast shutdown, which
    /// ends client sessions; SIGTERM's smart shutdown would wait for our
    /// own dispatcher's connections forever), then SIGKILL after 10 s.
    pub(crate) fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id().to_string();
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let give_up = Instant::now() + Duration::from_secs(10);
        while Instant::now() < give_up {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGKILLs the server (by PID), as a crash would, and waits (up to
    /// 30 s) until the backends it had started are gone too: they notice
    /// the postmaster's death and exit, and a new postmaster refuses to
    /// start while one still holds the old shared memory. [`Self::restart`]
    /// then runs crash recovery from the write-ahead log.
    pub(crate) fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id().to_string();
        let backends: Vec<String> = Command::new("pgrep")
            .args(["-P", &pid])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let _ = child.kill();
        let _ = child.wait();
        let give_up = Instant::now() + Duration::from_secs(30);
        // A zombie (state `Z`, not yet reaped by init) holds nothing.
        let alive = |pid: &String| {
            std::fs::read_to_string(Path::new("/proc").join(pid).join("stat")).is_ok_and(|stat| {
                stat.rsplit(") ")
                    .next()
                    .is_some_and(|s| !s.starts_with('Z'))
            })
        };
        while backends.iter().any(alive) {
            assert!(Instant::now() < give_up, "backends outlived the postmaster");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the server again on the same data directory and port.
    pub(crate) fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Runs one SQL text with `psql` (for fixtures written as upstream's
    /// producer would) and returns its unaligned output.
    pub(crate) fn psql(&self, sql: &str) -> String {
        let out = Command::new(self.bindir.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-d", "postgres", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .expect("psql runs");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The data directory's parent (logs, sockets).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
