//! Where a batch's requests go, and how they are stopped: the configured
//! queue, through the same producer paths `submit` and `cancel` use (the
//! embedded store's enqueue and cancel; Redis `enqueue` and the upstream
//! cancel protocol). The dispatcher and its gate are untouched: to them a
//! batch request is a message like any other.
//!
//! Intake progress: each chunk is enqueued together with the number of
//! input lines read through it, in one transaction (a `meta` row of the
//! embedded queue file; a key under `serve.key_prefix` set in the same
//! `MULTI` on Redis). A server killed mid-intake therefore left either the
//! chunk and its progress or neither, and the intake that resumes skips
//! exactly the lines already enqueued: no request is sent twice (issue 26).
//! On a Redis Cluster the progress key carries the queue's hash tag, so
//! the `MULTI` stays in the queue's slot.

use crate::redis::RedisConnection;
use bytes::Bytes;

use crate::queue::embedded::{EmbeddedError, EmbeddedQueue};
use crate::queue::redis::{Mark, Submission, cancel, enqueue_marked};
use crate::redis::hash_tag;
use crate::request::Message;

/// Why requests could not be enqueued or cancelled.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The embedded store refused.
    #[error("queue: {0}")]
    Embedded(#[from] EmbeddedError),
    /// A Redis round trip failed.
    #[error("queue: redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The blocking task of an embedded operation failed.
    #[error("queue: task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The queue a server feeds.
#[derive(Debug, Clone)]
pub enum Sink {
    /// A queue in the embedded store.
    Embedded(EmbeddedQueue),
    /// A Redis queue; results come back on `result_list`.
    Redis {
        /// Connection.
        conn: RedisConnection,
        /// The sorted set.
        queue: String,
        /// The list the messages name for their results.
        result_list: String,
        /// The dispatcher's fairness attribute: messages are also filed in
        /// their tenant's lane (`Submission::in_lane`).
        fairness_attribute: Option<String>,
        /// `serve.key_prefix`: intake progress keys live beside the batch
        /// records.
        key_prefix: String,
    },
}

/// How far a batch's intake got: the input lines read through the last
/// enqueued chunk.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// The batch.
    pub batch: &'a str,
    /// Input lines (1-based line numbers) read through this chunk.
    pub lines: u64,
}

/// How long a Redis progress key outlives its last chunk: longer than any
/// completion window (at most 7 days), so it is there for every resume; it
/// is deleted when the intake ends, the TTL only bounds a leak.
const PROGRESS_TTL_SECS: u64 = 8 * 86_400;

/// The embedded queue's `meta` key of a batch's intake progress.
fn progress_meta_key(batch: &str) -> String {
    format!("serve.intake.{batch}")
}

impl Sink {
    /// Enqueues `messages` (in order) in one round trip, recording
    /// `progress` in the same transaction (see the module docs).
    pub async fn enqueue(
        &self,
        messages: Vec<Message>,
        progress: Progress<'_>,
    ) -> Result<(), SinkError> {
        match self {
            Self::Embedded(queue) => {
                let items: Vec<(Bytes, i64)> = messages
                    .into_iter()
                    .map(|m| {
                        // A request is strings, numbers and raw JSON:
                        // serialising cannot fail.
                        let body = serde_json::to_vec(&m.request).unwrap_or_default();
                        (Bytes::from(body), m.request.deadline)
                    })
                    .collect();
                let queue = queue.clone();
                let (key, lines) = (
                    progress_meta_key(progress.batch),
                    progress.lines.to_string(),
                );
                tokio::task::spawn_blocking(move || {
                    queue.enqueue_with_deadlines(&items, &[(&key, &lines)])
                })
                .await??;
            }
            Self::Redis {
                conn,
                queue,
                result_list,
                fairness_attribute,
                key_prefix,
            } => {
                let now_ms = crate::clock::unix_millis();
                let submissions: Vec<Submission> = messages
                    .into_iter()
                    .enumerate()
                    .map(|(n, mut m)| {
                        m.request.result_queue_name = Some(result_list.clone());
                        let tenant = (fairness_attribute.as_deref())
                            .map(|a| m.request.metadata.get(a).cloned().unwrap_or_default());
                        Submission::new(m, queue, now_ms)
                            .in_sequence(n as u64)
                            .in_lane(tenant)
                    })
                    .collect();
                let mark = Mark {
                    key: progress_key(conn, queue, key_prefix, progress.batch),
                    value: progress.lines.to_string(),
                    ttl_secs: PROGRESS_TTL_SECS,
                };
                enqueue_marked(&mut conn.clone(), queue, &submissions, Some(&mark)).await?;
            }
        }
        Ok(())
    }

    /// The input lines of `batch` already enqueued (0 before the first
    /// chunk): where a resumed intake starts.
    pub async fn progress(&self, batch: &str) -> Result<u64, SinkError> {
        let text: Option<String> = match self {
            Self::Embedded(queue) => {
                let (queue, key) = (queue.clone(), progress_meta_key(batch));
                tokio::task::spawn_blocking(move || queue.meta(&key)).await??
            }
            Self::Redis {
                conn,
                queue,
                key_prefix,
                ..
            } => {
                redis::cmd("GET")
                    .arg(progress_key(conn, queue, key_prefix, batch))
                    .query_async(&mut conn.clone())
                    .await?
            }
        };
        // Only this module writes it, as a decimal number.
        Ok(text.and_then(|t| t.parse().ok()).unwrap_or(0))
    }

    /// Forgets `batch`'s intake progress once every line is enqueued.
    pub async fn forget_progress(&self, batch: &str) -> Result<(), SinkError> {
        match self {
            Self::Embedded(queue) => {
                let (queue, key) = (queue.clone(), progress_meta_key(batch));
                tokio::task::spawn_blocking(move || queue.remove_meta(&key)).await??;
            }
            Self::Redis {
                conn,
                queue,
                key_prefix,
                ..
            } => {
                redis::cmd("DEL")
                    .arg(progress_key(conn, queue, key_prefix, batch))
                    .query_async::<()>(&mut conn.clone())
                    .await?;
            }
        }
        Ok(())
    }

    /// Stops the batch's requests that have not been sent: each is
    /// answered `CANCELLED` (at once in the embedded store; by the
    /// dispatcher when it next takes it, with Redis). Requests in flight
    /// finish. `custom_ids` yields the batch's message ids (Redis cancels
    /// by id; the embedded store matches the batch prefix in one pass).
    pub async fn cancel(&self, batch_id: &str, message_ids: Vec<String>) -> Result<(), SinkError> {
        match self {
            Self::Embedded(queue) => {
                let prefix = format!("{batch_id}:");
                let queue = queue.clone();
                tokio::task::spawn_blocking(move || {
                    queue.cancel_where(|id| id.starts_with(&prefix))
                })
                .await??;
            }
            Self::Redis { conn, .. } => {
                let mut conn = conn.clone();
                for id in message_ids {
                    cancel(&mut conn, &id).await?;
                }
            }
        }
        Ok(())
    }

    /// Whether cancelling needs the message ids (Redis) or only the batch
    /// id (embedded).
    pub fn needs_ids(&self) -> bool {
        matches!(self, Self::Redis { .. })
    }
}

/// The Redis key of a batch's intake progress: `<prefix>intake:<batch>`;
/// on a cluster `{<queue tag>}:<prefix>intake:<batch>`, in the queue's
/// slot, so it is set in the same `MULTI` as the chunk's `ZADD`
/// (`enqueue_marked`).
fn progress_key(conn: &RedisConnection, queue: &str, prefix: &str, batch: &str) -> String {
    if conn.is_cluster() {
        let tag = hash_tag(queue).unwrap_or(queue);
        format!("{{{tag}}}:{prefix}intake:{batch}")
    } else {
        format!("{prefix}intake:{batch}")
    }
}
