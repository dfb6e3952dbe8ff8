//! A TTL cache in front of a [`Source`]: single-flight (at most one read in
//! flight), callers never queue behind a slow read while usable data
//! exists, errors are handed only to the callers of the failed attempt
//! (never cached), and data older than the staleness limit is never
//! returned.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{Source, SourceError, Timestamped};

type Outcome<T> = Option<Result<Timestamped<T>, SourceError>>;

struct State<T> {
    /// Newest successful read and when it arrived (the TTL runs from then).
    last: Option<(Timestamped<T>, Instant)>,
    /// The read in flight, if any; every caller that must wait shares it.
    in_flight: Option<watch::Receiver<Outcome<T>>>,
    /// The last error, for `gate probe` and logs only: never returned as a
    /// result to a caller that did not wait for that attempt.
    last_error: Option<SourceError>,
}

/// A cached, single-flight [`Source`].
pub struct Cached<S: Source> {
    source: Arc<S>,
    ttl: Duration,
    max_staleness: Duration,
    state: Arc<Mutex<State<S::Output>>>,
}

impl<S: Source> std::fmt::Debug for Cached<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cached")
            .field("source", &self.source)
            .field("ttl", &self.ttl)
            .field("max_staleness", &self.max_staleness)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding this lock leaves consistent data (plain field
    // writes), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<S: Source> Cached<S> {
    /// Caches `source` for `ttl`; data older than `max_staleness` (by its
    /// `taken_at`) is an error. Waiting for a read is bounded by
    /// `max_staleness` too.
    pub fn new(source: S, ttl: Duration, max_staleness: Duration) -> Self {
        Self {
            source: Arc::new(source),
            ttl,
            max_staleness,
            state: Arc::new(Mutex::new(State {
                last: None,
                in_flight: None,
                last_error: None,
            })),
        }
    }

    /// The wrapped source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The error of the newest failed read, if no read succeeded since.
    pub fn last_error(&self) -> Option<SourceError> {
        lock(&self.state).last_error.clone()
    }

    /// Cached data if fresh enough, else the result of the (shared) read.
    pub async fn get(&self) -> Result<Timestamped<S::Output>, SourceError> {
        let mut rx = {
            let mut state = lock(&self.state);
            let now = Instant::now();
            if let Some((data, fetched_at)) = &state.last
                && now.saturating_duration_since(*fetched_at) < self.ttl
                && now.saturating_duration_since(data.taken_at) <= self.max_staleness
            {
                return Ok(data.clone());
            }
            let rx = match &state.in_flight {
                // A read whose task died (a panic) left its sender dropped:
                // start a new one rather than failing forever.
                Some(rx) if rx.has_changed().is_ok() => rx.clone(),
                _ => self.start_read(&mut state),
            };
            // A refresh is under way; usable data is served meanwhile, so a
            // slow source never makes callers queue.
            if let Some((data, _)) = &state.last
                && now.saturating_duration_since(data.taken_at) <= self.max_staleness
            {
                return Ok(data.clone());
            }
            rx
        };
        let waited = tokio::time::timeout(self.max_staleness, async {
            match rx.wait_for(Option::is_some).await {
                Ok(outcome) => outcome.clone().unwrap_or(Err(SourceError::Abandoned)),
                Err(_) => Err(SourceError::Abandoned),
            }
        })
        .await
        .unwrap_or(Err(SourceError::Timeout(self.max_staleness)))?;
        let age = Instant::now().saturating_duration_since(waited.taken_at);
        if age > self.max_staleness {
            return Err(SourceError::Stale {
                age_ms: age.as_millis(),
                limit_ms: self.max_staleness.as_millis(),
            });
        }
        Ok(waited)
    }

    fn start_read(&self, state: &mut State<S::Output>) -> watch::Receiver<Outcome<S::Output>> {
        let (tx, rx) = watch::channel(None);
        state.in_flight = Some(rx.clone());
        let source = self.source.clone();
        let shared = self.state.clone();
        // A task of its own, so a caller that gives up (cancellation) does
        // not abort the read the others wait for.
        tokio::spawn(async move {
            let outcome = source.fetch().await;
            {
                let mut state = lock(&shared);
                state.in_flight = None;
                match &outcome {
                    Ok(data) => {
                        state.last = Some((data.clone(), Instant::now()));
                        state.last_error = None;
                    }
                    Err(e) => state.last_error = Some(e.clone()),
                }
            }
            let _ = tx.send(Some(outcome));
        });
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::future::BoxFuture;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Answers after `delay`; fails while `failing` is set.
    #[derive(Debug, Default)]
    struct Scripted {
        calls: AtomicUsize,
        delay: Duration,
        failing: std::sync::atomic::AtomicBool,
    }

    impl Source for Arc<Scripted> {
        type Output = usize;
        fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<usize>, SourceError>> {
            Box::pin(async move {
                let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
                let taken_at = Instant::now();
                tokio::time::sleep(self.delay).await;
                if self.failing.load(Ordering::SeqCst) {
                    Err(SourceError::Status(500))
                } else {
                    Ok(Timestamped { value: n, taken_at })
                }
            })
        }
        fn describe(&self) -> String {
            "scripted".into()
        }
    }

    fn cached(delay: Duration) -> (Arc<Scripted>, Arc<Cached<Arc<Scripted>>>) {
        let s = Arc::new(Scripted {
            delay,
            ..Default::default()
        });
        let c = Arc::new(Cached::new(
            s.clone(),
            Duration::from_secs(1),
            Duration::from_secs(10),
        ));
        (s, c)
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_callers_share_one_read() {
        let (s, c) = cached(Duration::from_millis(500));
        let results = futures_util::future::join_all((0..8).map(|_| c.get())).await;
        assert!(results.iter().all(|r| matches!(r, Ok(t) if t.value == 1)));
        assert_eq!(s.calls.load(Ordering::SeqCst), 1);
        // Within the TTL: no new read.
        assert_eq!(c.get().await.unwrap().value, 1);
        assert_eq!(s.calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn callers_get_cached_data_while_a_slow_refresh_runs() {
        let (s, c) = cached(Duration::from_secs(3));
        assert_eq!(c.get().await.unwrap().value, 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        // TTL expired: a refresh starts, but the caller is not held for 3 s.
        let started = Instant::now();
        assert_eq!(c.get().await.unwrap().value, 1);
        assert_eq!(c.get().await.unwrap().value, 1);
        assert_eq!(started.elapsed(), Duration::ZERO);
        tokio::task::yield_now().await;
        // One refresh for both callers.
        assert_eq!(s.calls.load(Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(c.get().await.unwrap().value, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn errors_are_not_cached_past_their_attempt() {
        let (s, c) = cached(Duration::ZERO);
        s.failing.store(true, Ordering::SeqCst);
        assert!(matches!(c.get().await, Err(SourceError::Status(500))));
        assert!(c.last_error().is_some());
        s.failing.store(false, Ordering::SeqCst);
        // The next call makes a new attempt instead of replaying the error.
        assert_eq!(c.get().await.unwrap().value, 2);
        assert!(c.last_error().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn data_past_the_staleness_limit_is_never_served() {
        let (s, c) = cached(Duration::ZERO);
        assert_eq!(c.get().await.unwrap().value, 1);
        s.failing.store(true, Ordering::SeqCst);
        // Failed refreshes: the old data is served while within the limit.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.get().await.unwrap().value, 1);
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(c.get().await.is_err());
    }

    /// Panics on its first read only.
    #[derive(Debug, Default)]
    struct PanicsOnce {
        calls: AtomicUsize,
    }

    impl Source for Arc<PanicsOnce> {
        type Output = usize;
        fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<usize>, SourceError>> {
            Box::pin(async move {
                if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("first read panics");
                }
                Ok(Timestamped {
                    value: 7,
                    taken_at: Instant::now(),
                })
            })
        }
        fn describe(&self) -> String {
            "panics once".into()
        }
    }

    #[tokio::test]
    async fn a_panicked_read_does_not_wedge_the_cache() {
        let c = Cached::new(
            Arc::new(PanicsOnce::default()),
            Duration::from_secs(1),
            Duration::from_secs(10),
        );
        assert!(matches!(c.get().await, Err(SourceError::Abandoned)));
        assert_eq!(c.get().await.unwrap().value, 7);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_is_bounded_by_the_staleness_limit() {
        let (_s, c) = cached(Duration::from_secs(60));
        assert!(matches!(c.get().await, Err(SourceError::Timeout(_))));
    }
}
