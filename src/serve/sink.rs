//! Where a batch's requests go, and how they are stopped: the configured
//! queue, through its client ([`crate::queue::Client`]), the same face
//! `submit` and `cancel` use. The dispatcher and its gate are untouched:
//! to them a batch request is a message like any other.
//!
//! Intake progress: each chunk is enqueued together with the number of
//! input lines read through it, as a mark in the same transaction (a
//! `meta` row of the embedded queue file; a key under `serve.key_prefix`
//! set in the same `MULTI` on Redis, in the queue's hash slot on a
//! cluster). A server killed mid-intake therefore left either the chunk
//! and its progress or neither, and the intake that resumes skips exactly
//! the lines already enqueued: no request is sent twice (issue 26).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::queue::{Client, ClientError, Mark, Outgoing};
use crate::request::Message;

/// Why requests could not be enqueued or cancelled.
pub type SinkError = ClientError;

/// The queue a server feeds.
#[derive(Debug, Clone)]
pub struct Sink {
    /// The queue's client.
    client: Arc<dyn Client>,
    /// What a batch's intake mark is called, before the batch id: in the
    /// namespace of the server's store (`Store::intake_mark_prefix`).
    mark_prefix: String,
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

/// How long a progress mark outlives its last chunk where keys expire
/// (Redis): longer than any completion window (at most 7 days), so it is
/// there for every resume; it is forgotten when the intake ends, the TTL
/// only bounds a leak.
const PROGRESS_TTL: Duration = Duration::from_secs(8 * 86_400);

impl Sink {
    /// A sink into `client`'s queue, its intake marks named
    /// `<mark_prefix><batch>`.
    pub fn new(client: Arc<dyn Client>, mark_prefix: String) -> Self {
        Self {
            client,
            mark_prefix,
        }
    }

    /// The queue's client (the collector reads results through it).
    pub fn client(&self) -> &Arc<dyn Client> {
        &self.client
    }

    fn mark_key(&self, batch: &str) -> String {
        format!("{}{batch}", self.mark_prefix)
    }

    /// Enqueues `messages` (in order) in one round trip, recording
    /// `progress` in the same transaction (see the module docs).
    pub async fn enqueue(
        &self,
        messages: Vec<Message>,
        progress: Progress<'_>,
    ) -> Result<(), SinkError> {
        let requests = (messages.into_iter())
            .map(|m| Outgoing {
                // A request is strings, numbers and raw JSON: serialising
                // cannot fail.
                body: Bytes::from(serde_json::to_vec(&m.request).unwrap_or_default()),
                deadline: m.request.deadline,
            })
            .collect();
        let mark = Mark {
            key: self.mark_key(progress.batch),
            value: progress.lines.to_string(),
            ttl: PROGRESS_TTL,
        };
        self.client.enqueue(requests, Some(mark)).await?;
        Ok(())
    }

    /// Enqueues one request on its own (a flex or background request):
    /// no intake mark, nothing to resume.
    pub async fn enqueue_one(&self, message: Message) -> Result<(), SinkError> {
        let request = Outgoing {
            body: Bytes::from(serde_json::to_vec(&message.request).unwrap_or_default()),
            deadline: message.request.deadline,
        };
        self.client.enqueue(vec![request], None).await?;
        Ok(())
    }

    /// Withdraws the requests among `message_ids` still waiting, never
    /// one a dispatcher took ([`crate::queue::Client::withdraw`]).
    pub async fn withdraw(&self, message_ids: Vec<String>) -> Result<Vec<bool>, SinkError> {
        self.client.withdraw(message_ids).await
    }

    /// Per id: whether a dispatcher holds it now.
    pub async fn leased(&self, message_ids: Vec<String>) -> Result<Vec<bool>, SinkError> {
        self.client.leased(message_ids).await
    }

    /// The input lines of `batch` already enqueued (0 before the first
    /// chunk): where a resumed intake starts.
    pub async fn progress(&self, batch: &str) -> Result<u64, SinkError> {
        let text = self.client.mark(self.mark_key(batch)).await?;
        // Only this module writes it, as a decimal number.
        Ok(text.and_then(|t| t.parse().ok()).unwrap_or(0))
    }

    /// Forgets `batch`'s intake progress once every line is enqueued.
    pub async fn forget_progress(&self, batch: &str) -> Result<(), SinkError> {
        self.client.forget_mark(self.mark_key(batch)).await
    }

    /// Stops the batch's requests that have not been sent (`message_ids`):
    /// each is answered `CANCELLED` (at once in the embedded store; by the
    /// dispatcher when it next takes it, with Redis). Requests in flight
    /// finish.
    pub async fn cancel(&self, message_ids: Vec<String>) -> Result<(), SinkError> {
        self.client.cancel(message_ids).await?;
        Ok(())
    }

    /// Stops the batch's requests no dispatcher has taken, as
    /// [`Self::cancel`] does; those a dispatcher holds go out (or have)
    /// and keep their answers (a batch's expiry, docs/batch-api.md).
    pub async fn expire(&self, message_ids: Vec<String>) -> Result<(), SinkError> {
        self.client.expire(message_ids).await?;
        Ok(())
    }
}
