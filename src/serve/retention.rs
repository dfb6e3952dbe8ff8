//! File retention, as OpenAI words it: an upload's `expires_after`
//! (`{anchor: created_at, seconds}`), a batch's `output_expires_after`
//! for its output and error files, and the server's default
//! (`serve.file_retention`) for files that name none. A file past its
//! `expires_at` answers 404 at once; the sweeper then deletes its body
//! and record, and reports the bytes of bodies still held.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::files::Bodies;
use super::store::{Store, StoreError};
use crate::clock::unix_secs;
use crate::telemetry::BatchApiMetrics;

/// Shortest `expires_after.seconds` OpenAI accepts (1 hour).
pub const MIN_EXPIRES_AFTER: i64 = 3600;
/// Longest `expires_after.seconds` OpenAI accepts (30 days).
pub const MAX_EXPIRES_AFTER: i64 = 2_592_000;
/// How long past its `expires_at` a file waits before the sweeper deletes
/// it. It answers 404 from `expires_at` on, so no new batch can take it as
/// input after then; the slack covers a batch whose creation checked the
/// file just before that instant and is still writing its record, which
/// the sweeper must see (it keeps the inputs of running batches).
const DELETE_SLACK_SECS: i64 = 5;
/// Longest pause between sweeps.
const MAX_SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Shortest pause between sweeps.
const MIN_SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A checked `expires_after`: seconds after the file's creation, within
/// OpenAI's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpiresAfter(i64);

impl ExpiresAfter {
    /// From an anchor and a number of seconds; the message says what is
    /// wrong, in the words of `param`.
    fn new(param: &str, anchor: Option<&str>, seconds: Option<i64>) -> Result<Self, String> {
        match anchor {
            Some("created_at") => {}
            Some(other) => {
                return Err(format!(
                    "Invalid '{param}': anchor `{other}` is not supported; the only anchor is `created_at`."
                ));
            }
            None => {
                return Err(format!(
                    "Invalid '{param}': anchor is required (`created_at`)."
                ));
            }
        }
        match seconds {
            Some(s) if (MIN_EXPIRES_AFTER..=MAX_EXPIRES_AFTER).contains(&s) => Ok(Self(s)),
            Some(s) => Err(format!(
                "Invalid '{param}': seconds is {s}; it must be between {MIN_EXPIRES_AFTER} (1 hour) and {MAX_EXPIRES_AFTER} (30 days)."
            )),
            None => Err(format!(
                "Invalid '{param}': seconds is required (an integer between {MIN_EXPIRES_AFTER} and {MAX_EXPIRES_AFTER})."
            )),
        }
    }

    /// An upload's multipart fields `expires_after[anchor]` and
    /// `expires_after[seconds]`; `None` when neither was sent.
    pub fn from_form(anchor: Option<&str>, seconds: Option<&str>) -> Result<Option<Self>, String> {
        if anchor.is_none() && seconds.is_none() {
            return Ok(None);
        }
        let seconds = match seconds {
            None => None,
            Some(text) => Some(text.trim().parse::<i64>().map_err(|_| {
                format!("Invalid 'expires_after': seconds `{text}` is not an integer.")
            })?),
        };
        Self::new("expires_after", anchor.map(str::trim), seconds).map(Some)
    }

    /// A JSON `{"anchor": "created_at", "seconds": N}` (a batch's
    /// `output_expires_after`).
    pub fn from_json(param: &str, value: &Value) -> Result<Self, String> {
        let Value::Object(object) = value else {
            return Err(format!(
                "Invalid '{param}': expected an object {{\"anchor\": \"created_at\", \"seconds\": N}}."
            ));
        };
        let seconds = match object.get("seconds") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_i64().ok_or_else(|| {
                format!("Invalid '{param}': seconds must be an integer, got {v}.")
            })?),
        };
        Self::new(param, object.get("anchor").and_then(Value::as_str), seconds)
    }

    /// The seconds after creation.
    pub const fn seconds(self) -> i64 {
        self.0
    }
}

/// The server's default retention (`serve.file_retention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// How long a file that names no expiry is kept; `None` = until
    /// deleted.
    default: Option<Duration>,
}

impl Retention {
    /// `serve.file_retention`: zero keeps files until deleted.
    pub fn new(default: Duration) -> Self {
        Self {
            default: (!default.is_zero()).then_some(default),
        }
    }

    /// The `expires_at` of a file created at `created_at` that asked for
    /// `given` seconds (or nothing: the default).
    pub fn expires_at(&self, created_at: i64, given: Option<i64>) -> Option<i64> {
        let secs = match given {
            Some(s) => s,
            None => {
                let d = self.default?;
                // Whole seconds, rounded up: a file never goes early.
                let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
                i64::try_from(secs).unwrap_or(i64::MAX)
            }
        };
        Some(created_at.saturating_add(secs))
    }

    /// How often the sweeper runs: half the default retention, between
    /// 1 s and 10 s (expiries are in whole seconds; a short default is
    /// for tests and demos, and deserves a prompt sweep).
    pub fn sweep_every(&self) -> Duration {
        self.default
            .map_or(MAX_SWEEP_EVERY, |d| d / 2)
            .clamp(MIN_SWEEP_EVERY, MAX_SWEEP_EVERY)
    }
}

/// Deletes expired files and reports the bytes of bodies held.
#[derive(Debug, Clone)]
pub struct Sweeper {
    /// Records (all replicas').
    pub store: Store,
    /// Bodies (the shared volume).
    pub bodies: Bodies,
    /// The `batch_file_bytes` gauge.
    pub metrics: BatchApiMetrics,
    /// Pause between sweeps.
    pub every: Duration,
}

impl Sweeper {
    /// Sweeps every [`Sweeper::every`] until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            if let Err(error) = self.sweep(unix_secs()).await {
                tracing::warn!(%error, "file retention sweep failed; retrying");
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.every) => {}
            }
        }
    }

    /// Deletes every file expired by `now` (Unix seconds, less
    /// [`DELETE_SLACK_SECS`]), body first, so a crash between the two
    /// leaves a record that already answers 404 and is swept again, never
    /// a body no record names. The input of a batch that has not ended is
    /// kept until it ends (the server reads it again to enqueue, cancel
    /// and expire). Returns how many were deleted.
    pub async fn sweep(&self, now: i64) -> Result<u64, SweepError> {
        let expired = self
            .store
            .expired_files(now.saturating_sub(DELETE_SLACK_SECS))
            .await?;
        let mut deleted = 0;
        if !expired.is_empty() {
            let inputs: HashSet<String> = (self.store.active_batches().await?.into_iter())
                .map(|b| b.input_file_id)
                .collect();
            for file in expired.iter().filter(|f| !inputs.contains(&f.id)) {
                self.bodies.remove(&file.id).await?;
                self.store.delete_file(&file.id).await?;
                tracing::info!(file = %file.id, tenant = %file.tenant, bytes = file.bytes, "expired file deleted");
                deleted += 1;
            }
        }
        self.metrics.set_file_bytes(self.store.file_bytes().await?);
        Ok(deleted)
    }
}

/// Why a retention sweep stopped (it is tried again at the next period).
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A file body could not be deleted.
    #[error("file body: {0}")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::model::FileRecord;
    use crate::serve::store::SqliteStore;
    use serde_json::json;

    #[test]
    fn expires_after_follows_openais_range_and_anchor() {
        let ok = ExpiresAfter::from_form(Some("created_at"), Some("3600")).expect("valid");
        assert_eq!(ok.map(ExpiresAfter::seconds), Some(3600));
        assert_eq!(ExpiresAfter::from_form(None, None), Ok(None));
        for (anchor, seconds) in [
            (Some("created_at"), Some("3599")),
            (Some("created_at"), Some("2592001")),
            (Some("created_at"), Some("1h")),
            (Some("created_at"), None),
            (Some("last_active_at"), Some("3600")),
            (None, Some("3600")),
        ] {
            let e = ExpiresAfter::from_form(anchor, seconds).expect_err("refused");
            assert!(e.starts_with("Invalid 'expires_after'"), "{e}");
        }
        let json_ok = json!({"anchor": "created_at", "seconds": 2_592_000});
        assert_eq!(
            ExpiresAfter::from_json("output_expires_after", &json_ok).map(ExpiresAfter::seconds),
            Ok(2_592_000)
        );
        for bad in [
            json!({"anchor": "created_at", "seconds": 60}),
            json!({"anchor": "created_at", "seconds": "3600"}),
            json!({"seconds": 3600}),
            json!(3600),
        ] {
            let e = ExpiresAfter::from_json("output_expires_after", &bad).expect_err("refused");
            assert!(e.contains("output_expires_after"), "{e}");
        }
    }

    #[test]
    fn the_default_applies_only_when_no_expiry_is_asked() {
        let keep = Retention::new(Duration::ZERO);
        assert_eq!(keep.expires_at(100, None), None);
        assert_eq!(keep.expires_at(100, Some(3600)), Some(3700));
        let month = Retention::new(Duration::from_secs(30 * 86_400));
        assert_eq!(month.expires_at(100, None), Some(100 + 30 * 86_400));
        assert_eq!(month.expires_at(100, Some(3600)), Some(3700));
        // Rounded up: never earlier than asked.
        let short = Retention::new(Duration::from_millis(1500));
        assert_eq!(short.expires_at(100, None), Some(102));
        assert_eq!(short.sweep_every(), MIN_SWEEP_EVERY);
        assert_eq!(month.sweep_every(), MAX_SWEEP_EVERY);
        assert_eq!(keep.sweep_every(), MAX_SWEEP_EVERY);
    }

    /// On an injected clock: a file whose `expires_after` (an hour at
    /// least) has passed is deleted, body and record, and the gauge
    /// drops by its bytes; an input of a running batch stays.
    #[tokio::test]
    async fn the_sweep_deletes_expired_files_but_not_running_inputs() {
        let dir = std::env::temp_dir().join(format!("sluicegate-ret-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("dir");
        let metrics = crate::telemetry::Metrics::new();
        let sweeper = Sweeper {
            store: Store::Sqlite(SqliteStore::open(&dir.join("batches.db")).expect("store")),
            bodies: Bodies::open(&dir).expect("bodies"),
            metrics: metrics.batch_api("q"),
            every: Duration::from_secs(1),
        };
        let created = 1_000_000;
        let file = |id: &str, bytes: u64, expires_at: Option<i64>| FileRecord {
            id: id.into(),
            tenant: "t".into(),
            bytes,
            created_at: created,
            filename: "f.jsonl".into(),
            purpose: "batch".into(),
            expires_at,
        };
        let hour = Some(created + 3600);
        for f in [
            file("file-old", 10, hour),
            file("file-input", 20, hour),
            file("file-kept", 40, None),
        ] {
            std::fs::write(sweeper.bodies.path(&f.id), vec![b'x'; f.bytes as usize]).expect("body");
            sweeper.store.put_file(&f).await.expect("put");
        }
        let batch = crate::serve::model::BatchRecord::new(crate::serve::model::NewBatch {
            tenant: "t".into(),
            endpoint: "/v1/completions".into(),
            input_file_id: "file-input".into(),
            completion_window: "24h".into(),
            window_secs: 86_400,
            metadata: Default::default(),
            output_expires_after: None,
        });
        sweeper.store.insert_batch(&batch).await.expect("batch");

        assert_eq!(sweeper.sweep(created + 3599).await.expect("sweep"), 0);
        assert!(
            metrics
                .encode()
                .contains("sluicegate_batch_file_bytes{queue=\"q\"} 70")
        );
        let later = created + 3600 + DELETE_SLACK_SECS;
        assert_eq!(sweeper.sweep(later).await.expect("sweep"), 1);
        assert!(
            sweeper
                .store
                .file("file-old")
                .await
                .expect("read")
                .is_none()
        );
        assert!(!sweeper.bodies.path("file-old").exists());
        assert!(sweeper.bodies.path("file-input").exists());
        assert!(
            sweeper
                .store
                .file("file-kept")
                .await
                .expect("read")
                .is_some()
        );
        assert!(
            metrics
                .encode()
                .contains("sluicegate_batch_file_bytes{queue=\"q\"} 60")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
