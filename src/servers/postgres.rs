//! A real PostgreSQL server on a free 127.0.0.1 port, in a scratch data
//! directory made by `initdb`, run as the `postgres` binary directly so
//! its PID is ours to stop (on drop too). Never the machine-wide server.
//!
//! PostgreSQL refuses to run as root: when we run as root (CI), the
//! directory is handed to the `postgres` user and `initdb` / `postgres`
//! run through `setpriv`, which execs, so the PID stays the server's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// A running (or stopped) PostgreSQL server.
#[derive(Debug)]
pub struct Postgres {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
    dir: PathBuf,
    bindir: PathBuf,
    as_postgres: bool,
    /// `-c` settings beyond the defaults (e.g. `ssl=on`), given on every start.
    settings: Vec<String>,
}

/// The directory holding `initdb` and `postgres`: `pg_config --bindir`,
/// else the newest `/usr/lib/postgresql/*/bin`.
fn bindir() -> Result<PathBuf, String> {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|d| d.join("initdb").is_file() && d.join("postgres").is_file());
    if let Some(dir) = from_pg_config {
        return Ok(dir);
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
    found.pop().ok_or_else(|| {
        "PostgreSQL server binaries (initdb, postgres): install Debian's `postgresql` package"
            .to_owned()
    })
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
    pub fn start() -> Result<Self, String> {
        let mut server = Self::init()?;
        server.run()?;
        Ok(server)
    }

    /// `initdb` in a fresh directory, without starting the server (so
    /// the caller can add files and [`Self::set`] settings, then
    /// [`Self::run`]).
    pub fn init() -> Result<Self, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("sluicegate-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let server = Self {
            child: None,
            port,
            dir,
            bindir: bindir()?,
            as_postgres: is_root(),
            settings: Vec::new(),
        };
        server.give_to_postgres(&[&server.dir])?;
        let out = server
            .command("initdb")
            .arg("-D")
            .arg(server.data())
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .output()
            .map_err(|e| format!("initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(server)
    }

    /// Adds `-c key=value` to every later start.
    pub fn set(&mut self, setting: &str) {
        self.settings.push(setting.to_owned());
    }

    /// When we run as root, hands `paths` (recursively) to the `postgres`
    /// user, which the server runs as; otherwise nothing.
    pub fn give_to_postgres(&self, paths: &[&Path]) -> Result<(), String> {
        if !self.as_postgres {
            return Ok(());
        }
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .args(paths)
            .status()
            .map_err(|e| format!("chown: {e}"))?
            .success();
        if ok {
            Ok(())
        } else {
            Err(format!("chown {paths:?} to postgres failed"))
        }
    }

    /// The data directory.
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The data directory's parent (logs, sockets).
    pub fn dir(&self) -> &Path {
        &self.dir
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
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts the server on the data directory and waits (up to 30 s)
    /// until it accepts connections.
    pub fn run(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.join("server.log"))
            .map_err(|e| format!("server.log: {e}"))?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
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
            ]);
        for setting in &self.settings {
            cmd.args(["-c", setting]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("postgres starts: {e}"))?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!(
                    "postgres exited at start ({status}): {}",
                    self.log()
                ));
            }
            let ready = Command::new(self.bindir.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-U", "postgres"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return Ok(());
            }
            if Instant::now() >= give_up {
                return Err(format!("postgres not ready: {}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Stops the server by PID: SIGINT (PostgreSQL's fast shutdown, which
    /// ends client sessions; SIGTERM's smart shutdown would wait for our
    /// own dispatcher's connections forever), then SIGKILL after 10 s.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = super::signal("INT", &child.id().to_string());
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
    pub fn kill(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
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
            if Instant::now() >= give_up {
                return Err("backends outlived the postmaster".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the server again on the same data directory and port.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.run()
    }

    /// Runs one SQL text with `psql` and returns its unaligned output.
    pub fn psql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(self.bindir.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres"])
            .args(["-d", "postgres", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .map_err(|e| format!("psql: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "psql {sql}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
