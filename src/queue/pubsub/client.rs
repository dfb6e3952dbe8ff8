//! The Pub/Sub transport's client face ([`crate::queue::Client`]):
//! requests published to the request topic as the plain request JSON
//! (upstream's Pub/Sub format), every publish confirmed; results pulled
//! from a subscription on the result topic and acknowledged once the
//! reader holds them. Pub/Sub has no cancel and cannot tell which ids are
//! active.

use std::collections::HashMap;

use futures_util::future::BoxFuture;
use gcloud_gax::grpc::Status;
use gcloud_pubsub::publisher::Publisher;
use gcloud_pubsub::subscription::Subscription;

use super::{publish_confirmed, pubsub_message};
use crate::queue::QueueError;
use crate::queue::client::{
    CancelOutcome, Client, ClientError, Cursor, Description, Mark, Outgoing, ReadResult, Receipt,
    ResultPage,
};

/// A producer on a request topic and a reader of a result subscription.
pub struct PubSubClient {
    /// The request topic's id and publisher, when enqueueing.
    topic: Option<(String, Publisher)>,
    /// The result subscription's id and handle, when reading results.
    subscription: Option<(String, Subscription)>,
}

impl std::fmt::Debug for PubSubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PubSubClient")
            .field("topic", &self.topic.as_ref().map(|t| &t.0))
            .field("subscription", &self.subscription.as_ref().map(|s| &s.0))
            .finish()
    }
}

impl PubSubClient {
    /// A client publishing to `topic` and reading `subscription` (either
    /// may be absent when unused) on `client`'s project.
    pub fn new(
        client: &gcloud_pubsub::client::Client,
        topic: Option<String>,
        subscription: Option<String>,
    ) -> Self {
        Self {
            topic: topic.map(|t| {
                let publisher = client.topic(&t).new_publisher(None);
                (t, publisher)
            }),
            subscription: subscription.map(|s| {
                let handle = client.subscription(&s);
                (s, handle)
            }),
        }
    }

    fn error(op: &'static str) -> impl Fn(Status) -> ClientError {
        move |source| QueueError::PubSub { op, source }.into()
    }
}

impl Client for PubSubClient {
    fn describe(&self) -> Description {
        let name = |n: Option<&String>| n.map_or_else(String::new, |n| format!("`{n}`"));
        Description {
            place: format!("topic {}", name(self.topic.as_ref().map(|t| &t.0))),
            results: format!(
                "subscription {}",
                name(self.subscription.as_ref().map(|s| &s.0))
            ),
            items: "requests",
            active: "active",
        }
    }

    fn transport(&self) -> &'static str {
        "pubsub"
    }

    /// Publishes in order and waits for every confirmation; a failed one
    /// fails the call (the ones before it are published).
    fn enqueue(
        &self,
        requests: Vec<Outgoing>,
        mark: Option<Mark>,
    ) -> BoxFuture<'_, Result<u64, ClientError>> {
        Box::pin(async move {
            self.refuse_mark(mark.as_ref())?;
            let Some((_, publisher)) = &self.topic else {
                return Err(self.unsupported("enqueue without a request topic"));
            };
            let messages = (requests.into_iter())
                .map(|r| pubsub_message(r.body.to_vec(), HashMap::new()))
                .collect();
            let mut published = 0;
            for outcome in publish_confirmed(publisher, messages).await {
                outcome.map_err(Self::error("publish"))?;
                published += 1;
            }
            Ok(published)
        })
    }

    fn cancel(&self, _ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(std::future::ready(Err(self.unsupported("cancel requests"))))
    }

    /// One pull of up to `max` (Pub/Sub allows 1000); the cursor is
    /// ignored. Unacknowledged results come back after the ack deadline.
    fn results(
        &self,
        _cursor: Cursor,
        max: usize,
    ) -> BoxFuture<'_, Result<ResultPage, ClientError>> {
        Box::pin(async move {
            let Some((_, subscription)) = &self.subscription else {
                return Err(self.unsupported("read results without a result subscription"));
            };
            let max = i32::try_from(max.clamp(1, super::MAX_PULL)).unwrap_or(1000);
            let pulled =
                (subscription.pull(max, None).await).map_err(Self::error("pull results"))?;
            let results = (pulled.into_iter())
                .map(|m| {
                    let raw = String::from_utf8_lossy(&m.message.data).into_owned();
                    ReadResult::with_receipt(raw, Receipt::Ack(m.ack_id))
                })
                .collect();
            Ok(ResultPage {
                results,
                cursor: Cursor::default(),
            })
        })
    }

    /// Acknowledges every result read, foreign ones too: the subscription
    /// is this reader's own, there is no one to keep them for.
    fn confirm(
        &self,
        taken: Vec<ReadResult>,
        foreign: Vec<ReadResult>,
    ) -> BoxFuture<'_, Result<(), ClientError>> {
        Box::pin(async move {
            let Some((_, subscription)) = &self.subscription else {
                return Ok(());
            };
            let ack_ids: Vec<String> = (taken.into_iter().chain(foreign))
                .filter_map(|r| match r.receipt {
                    Receipt::Ack(id) => Some(id),
                    Receipt::Kept | Receipt::ListEntry => None,
                })
                .collect();
            if ack_ids.is_empty() {
                return Ok(());
            }
            (subscription.ack(ack_ids).await).map_err(Self::error("ack results"))
        })
    }

    /// Pub/Sub cannot tell which messages are still on the broker.
    fn active(&self, _ids: Vec<String>) -> BoxFuture<'_, Result<Option<Vec<String>>, ClientError>> {
        Box::pin(std::future::ready(Ok(None)))
    }
}
