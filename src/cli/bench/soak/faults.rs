//! The faults of the soak: the fault gateway in front of the pool (429,
//! 503 and connection-reset storms), the seeded order in which the kinds
//! of fault are dealt, and the tally of the faults done.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the fault gateway does with a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Forwarded to the pool.
    Pass = 0,
    /// Answered 429 without `Retry-After`.
    TooMany = 1,
    /// Answered 503.
    Unavailable = 2,
    /// Reset (closed with RST) before any answer.
    Reset = 3,
}

impl Mode {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::TooMany,
            2 => Self::Unavailable,
            3 => Self::Reset,
            _ => Self::Pass,
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Pass => "none",
            Self::TooMany => "429",
            Self::Unavailable => "503",
            Self::Reset => "reset",
        }
    }
}

/// One storm: how long, and the attempts it met.
pub(super) struct Storm {
    pub(super) mode: Mode,
    pub(super) lasted: Duration,
    pub(super) attempts: u64,
}

/// A TCP gateway in front of the pool that forwards, or refuses every
/// request of a storm: each connection is decided when it opens, and a
/// storm also cuts the connections it finds open (a gateway restart), so
/// kept-alive connections cannot bypass it.
pub(super) struct FaultGateway {
    addr: std::net::SocketAddr,
    mode: Arc<AtomicU8>,
    refused: Arc<AtomicU64>,
    cut: watch::Sender<u64>,
}

impl FaultGateway {
    pub(super) async fn start(pool: String) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let pool_addr = url::Url::parse(&pool)
            .ok()
            .and_then(|u| u.socket_addrs(|| None).ok()?.into_iter().next())
            .ok_or_else(|| format!("pool address {pool}"))?;
        let mode = Arc::new(AtomicU8::new(Mode::Pass as u8));
        let refused = Arc::new(AtomicU64::new(0));
        let (cut, _) = watch::channel(0u64);
        let gateway = Self {
            addr,
            mode: mode.clone(),
            refused: refused.clone(),
            cut: cut.clone(),
        };
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let mode = Mode::from_u8(mode.load(Ordering::SeqCst));
                let refused = refused.clone();
                let mut cut = cut.subscribe();
                tokio::spawn(async move {
                    match mode {
                        Mode::Pass => {
                            let Ok(mut upstream) = TcpStream::connect(pool_addr).await else {
                                return;
                            };
                            let mut conn = conn;
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream) => {}
                                _ = cut.changed() => {}
                            }
                        }
                        Mode::Reset => {
                            refused.fetch_add(1, Ordering::SeqCst);
                            let _ = conn.set_zero_linger();
                        }
                        Mode::TooMany | Mode::Unavailable => {
                            refused.fetch_add(1, Ordering::SeqCst);
                            refuse(conn, mode).await;
                        }
                    }
                });
            }
        });
        Ok(gateway)
    }

    pub(super) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Refuses everything for `lasted` in `mode`, then forwards again.
    pub(super) async fn storm(&self, mode: Mode, lasted: Duration) -> Storm {
        let before = self.refused.load(Ordering::SeqCst);
        self.mode.store(mode as u8, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
        tokio::time::sleep(lasted).await;
        self.mode.store(Mode::Pass as u8, Ordering::SeqCst);
        Storm {
            mode,
            lasted,
            attempts: self.refused.load(Ordering::SeqCst) - before,
        }
    }
}

/// Reads one request head and answers it `mode`'s status, then closes.
async fn refuse(mut conn: TcpStream, mode: Mode) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut len = 0;
    loop {
        let Ok(n) = conn.read(&mut buf[len..]).await else {
            return;
        };
        if n == 0 {
            return;
        }
        len += n;
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(_)) => break,
            Ok(httparse::Status::Partial) if len < buf.len() => {}
            _ => return,
        }
    }
    let status = if mode == Mode::TooMany {
        "429 Too Many Requests"
    } else {
        "503 Service Unavailable"
    };
    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let _ = conn.write_all(answer.as_bytes()).await;
    let _ = conn.shutdown().await;
}

/// `0..n` in a seeded random order (Fisher–Yates).
pub(super) fn shuffled(rng: &mut Xoshiro256PlusPlus, n: u8) -> Vec<u8> {
    let mut deck: Vec<u8> = (0..n).collect();
    for i in (1..deck.len()).rev() {
        deck.swap(i, rng.random_range(0..=i));
    }
    deck
}

#[derive(Default)]
pub(super) struct Faults {
    pub(super) kills: u64,
    pub(super) stops: u64,
    pub(super) server_restarts: u64,
    pub(super) storms: Vec<Storm>,
    pub(super) last_at: Option<Instant>,
}

impl Faults {
    /// Replica and gateway faults so far.
    pub(super) fn random(&self) -> u64 {
        self.kills + self.stops + self.storms.len() as u64
    }
}
