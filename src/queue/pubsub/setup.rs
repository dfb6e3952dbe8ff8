//! `sluicegate pubsub setup`: the request topic and its subscription (retry
//! policy, dead-letter topic, optionally exactly-once delivery), the
//! dead-letter topic with a subscription to read it, and the result topic
//! with a subscription for `sluicegate results`. Existing resources are
//! left as they are (reported, not changed), so setup can be re-run.

use std::time::Duration;

use gcloud_googleapis::pubsub::v1::{DeadLetterPolicy, RetryPolicy};
use gcloud_pubsub::client::Client;
use gcloud_pubsub::subscription::SubscriptionConfig;

use super::PubSubError;

/// `pubsub setup`'s `--max-delivery-attempts`: Pub/Sub's ceiling. Broker
/// dead-lettering is a last resort: the broker counts every redelivery
/// (a failed attempt handed back, a lease that expired when a dispatcher
/// died) and tells nobody when it dead-letters, so no result is published
/// for such a message. The dispatcher's own `dispatch.max_attempts` should
/// decide first; and a delivery that reaches this limit anyway is answered
/// by the dispatcher before the broker would dead-letter it
/// (`docs/transports.md`, "Retries and dead letters").
pub const DEFAULT_MAX_DELIVERY_ATTEMPTS: i32 = 100;

/// What to create.
#[derive(Debug, Clone)]
pub struct SetupPlan {
    /// Topic submitters publish requests to.
    pub request_topic: String,
    /// The dispatcher's subscription on it (`queue_name` / `subscriber_id`).
    pub subscription: String,
    /// Topic the broker moves a message to after `max_delivery_attempts`;
    /// `None` = no dead-letter policy (and no delivery attempt counts).
    pub dead_letter_topic: Option<String>,
    /// Deliveries before the broker dead-letters (Pub/Sub allows 5..=100).
    pub max_delivery_attempts: i32,
    /// Retry policy: the broker's redelivery backoff after a nack.
    pub min_backoff: Duration,
    /// Retry policy ceiling.
    pub max_backoff: Duration,
    /// The subscription's ack deadline, in seconds (10..=600).
    pub ack_deadline_secs: i32,
    /// Exactly-once delivery on the request subscription.
    pub exactly_once: bool,
    /// Topic results are published to (`[pubsub] result_topic_id`).
    pub result_topic: String,
    /// A subscription on the result topic for readers; `None` = none.
    pub result_subscription: Option<String>,
}

impl SetupPlan {
    /// The subscription created on the dead-letter topic, so what lands
    /// there is kept and can be read.
    pub fn dead_letter_subscription(&self) -> Option<String> {
        self.dead_letter_topic.as_ref().map(|t| format!("{t}-sub"))
    }
}

fn rpc(op: &'static str, name: &str) -> impl FnOnce(gcloud_gax::grpc::Status) -> PubSubError {
    let name = name.to_owned();
    move |source| PubSubError::Rpc { op, name, source }
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

async fn topic(client: &Client, id: &str, done: &mut Vec<String>) -> Result<(), PubSubError> {
    let topic = client.topic(id);
    if topic.exists(None).await.map_err(rpc("get topic", id))? {
        done.push(format!("topic {id}: exists, left as is"));
    } else {
        topic
            .create(None, None)
            .await
            .map_err(rpc("create topic", id))?;
        done.push(format!("topic {id}: created"));
    }
    Ok(())
}

async fn subscription(
    client: &Client,
    id: &str,
    topic: &str,
    config: SubscriptionConfig,
    what: &str,
    done: &mut Vec<String>,
) -> Result<(), PubSubError> {
    let sub = client.subscription(id);
    if sub
        .exists(None)
        .await
        .map_err(rpc("get subscription", id))?
    {
        done.push(format!("subscription {id}: exists, left as is"));
        return Ok(());
    }
    let fqtn = client.fully_qualified_topic_name(topic);
    sub.create(&fqtn, config, None)
        .await
        .map_err(rpc("create subscription", id))?;
    done.push(format!("subscription {id} on {topic}: created{what}"));
    Ok(())
}

/// Creates what `plan` names and does not exist yet; one line per
/// resource says what happened.
pub async fn setup(client: &Client, plan: &SetupPlan) -> Result<Vec<String>, PubSubError> {
    let mut done = Vec::new();
    topic(client, &plan.request_topic, &mut done).await?;
    topic(client, &plan.result_topic, &mut done).await?;
    if let (Some(dlt), Some(dls)) = (&plan.dead_letter_topic, plan.dead_letter_subscription()) {
        topic(client, dlt, &mut done).await?;
        subscription(
            client,
            &dls,
            dlt,
            SubscriptionConfig::default(),
            "",
            &mut done,
        )
        .await?;
    }
    let config = SubscriptionConfig {
        ack_deadline_seconds: plan.ack_deadline_secs,
        enable_exactly_once_delivery: plan.exactly_once,
        retry_policy: Some(RetryPolicy {
            minimum_backoff: Some(duration(plan.min_backoff)),
            maximum_backoff: Some(duration(plan.max_backoff)),
        }),
        dead_letter_policy: plan.dead_letter_topic.as_ref().map(|t| DeadLetterPolicy {
            dead_letter_topic: client.fully_qualified_topic_name(t),
            max_delivery_attempts: plan.max_delivery_attempts,
        }),
        ..SubscriptionConfig::default()
    };
    let what = format!(
        " (ack deadline {}s, retry backoff {:?}..{:?}{}{})",
        plan.ack_deadline_secs,
        plan.min_backoff,
        plan.max_backoff,
        plan.dead_letter_topic
            .as_ref()
            .map(|t| format!(
                ", dead letters to {t} after {} deliveries",
                plan.max_delivery_attempts
            ))
            .unwrap_or_default(),
        if plan.exactly_once {
            ", exactly-once delivery"
        } else {
            ""
        },
    );
    subscription(
        client,
        &plan.subscription,
        &plan.request_topic,
        config,
        &what,
        &mut done,
    )
    .await?;
    if let Some(rs) = &plan.result_subscription {
        let config = SubscriptionConfig {
            ack_deadline_seconds: plan.ack_deadline_secs,
            ..SubscriptionConfig::default()
        };
        subscription(client, rs, &plan.result_topic, config, "", &mut done).await?;
    }
    Ok(done)
}
