//! The official Pub/Sub emulator (`gcloud beta emulators pubsub start`) on
//! a free 127.0.0.1 port, stopped by process group: gcloud's Python
//! wrapper spawns the Java server as a child, so the wrapper is started as
//! the leader of its own group and the whole group is killed (on drop
//! too), leaving no java behind. Restartable on the same port; the
//! emulator keeps its state in memory only, so a restart starts empty.

use std::io::{Read as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{ScratchDir, free_port};

/// A running (or stopped) emulator.
#[derive(Debug)]
pub struct Emulator {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: ScratchDir,
}

impl Emulator {
    /// Starts the emulator and waits (up to 60 s) until it answers.
    pub fn start() -> Result<Self, String> {
        let mut e = Self {
            child: None,
            port: free_port()?,
            dir: ScratchDir::new("pubsub-emulator")?,
        };
        e.spawn()?;
        Ok(e)
    }

    /// `host:port`, as `PUBSUB_EMULATOR_HOST` and `[pubsub] emulator_host` take it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("emulator.log")).unwrap_or_default()
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.path().join("emulator.log"))
            .map_err(|e| format!("emulator.log: {e}"))?;
        let err = log.try_clone().map_err(|e| format!("emulator.log: {e}"))?;
        let child = Command::new("gcloud")
            .args(["beta", "emulators", "pubsub", "start"])
            .arg(format!("--host-port=127.0.0.1:{}", self.port))
            .arg(format!("--data-dir={}", self.dir.path().display()))
            .arg("--quiet")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| {
                format!("gcloud starts (is the Cloud SDK with the pubsub emulator installed?): {e}")
            })?;
        self.child = Some(child);
        let give_up = Instant::now() + Duration::from_secs(60);
        while !self.answers() {
            if Instant::now() >= give_up {
                return Err(format!(
                    "the emulator did not answer within 60 s: {}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// Whether the emulator answers an HTTP GET / with 200.
    fn answers(&self) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut buf = [0u8; 64];
        matches!(s.read(&mut buf), Ok(n) if n > 12 && buf[..n].starts_with(b"HTTP/1.1 200"))
    }

    /// Kills the whole process group (wrapper and java), reaps it and
    /// waits (up to 10 s) until nothing of the group is left.
    pub fn stop(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let group = format!("-{}", child.id());
        let _ = super::signal("KILL", &group);
        let _ = child.wait();
        // Nothing of the group may survive (java ignores nothing sent
        // with KILL, but check rather than assume).
        let give_up = Instant::now() + Duration::from_secs(10);
        while super::alive(&group) {
            if Instant::now() >= give_up {
                return Err(format!("emulator group {group} survived"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Stops and starts again on the same port (with empty state).
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop()?;
        self.spawn()
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
