//! Where the soak's messages wait and its results land, one arm per
//! transport (`--transport`): enqueueing, the replicas' settings for it,
//! reading new results into the tally, and the store's own fault (its
//! server SIGKILLed and restarted). The shared window is on the bench's
//! Redis whatever the transport.
//!
//! - `redis`: the queue on that same Redis; the fault restarts it.
//! - `sql`: the bench's own PostgreSQL (`crate::servers::Postgres`); the
//!   fault SIGKILLs the postmaster and restarts it (crash recovery from
//!   the write-ahead log; `fsync = off` costs nothing here, since the
//!   kernel's page cache outlives the process).
//! - `pubsub`: the emulator. It keeps its state in memory only, so a
//!   restart would lose every message by design; the fault restarts the
//!   shared window's Redis instead.

use std::process::Command;
use std::time::Duration;

use clap::ValueEnum;

use super::super::measure::bench_requests;
use super::tally::Tally;
use crate::queue::Client;
use crate::queue::pubsub::{PubSubClient, SetupPlan, Target, connect_to, setup};
use crate::queue::redis::RedisClient;
use crate::queue::sql::{SqlClient, SqlQueueClient};
use crate::redis::{RedisConnection, connection};
use crate::secret::EndpointUrl;
use crate::servers::{Emulator, Postgres, RedisServer};

/// `--transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Transport {
    Redis,
    Sql,
    Pubsub,
}

/// The queue (Redis key, `queue` column, Pub/Sub topic prefix).
pub(super) const QUEUE: &str = "soak";
/// The result list, route or topic prefix.
pub(super) const RESULTS: &str = "soak-results";
/// Messages per enqueue call (Pub/Sub publishes at most 1 000 per request).
const CHUNK: usize = 1_000;
const PROJECT: &str = "sluicegate-soak";

/// The store of one soak run and how far its results were read.
pub(super) enum Store {
    Redis {
        conn: RedisConnection,
        /// Entries of the result list read so far.
        read: isize,
    },
    Sql {
        server: Postgres,
        client: SqlClient,
        url: String,
        /// The highest result `seq` read.
        after: i64,
    },
    PubSub {
        emulator: Emulator,
        client: gcloud_pubsub::client::Client,
        plan: SetupPlan,
    },
}

impl Store {
    /// Starts the transport's server (none for Redis: the bench's own) and
    /// creates what the queue needs.
    pub(super) async fn start(transport: Transport, redis: &RedisServer) -> Result<Self, String> {
        match transport {
            Transport::Redis => Ok(Self::Redis {
                conn: connection(&redis.config()).map_err(|e| e.to_string())?,
                read: 0,
            }),
            Transport::Sql => {
                let server = tokio::task::block_in_place(Postgres::start)?;
                let url = server.url();
                let endpoint = EndpointUrl::new(url::Url::parse(&url).map_err(|e| e.to_string())?);
                let client = SqlClient::open(&endpoint, Duration::from_secs(5))
                    .await
                    .map_err(|e| format!("sql: {e}"))?;
                Ok(Self::Sql {
                    server,
                    client,
                    url,
                    after: 0,
                })
            }
            Transport::Pubsub => {
                let emulator = tokio::task::block_in_place(Emulator::start)?;
                let client = connect_to(PROJECT, Target::Emulator(emulator.host()))
                    .await
                    .map_err(|e| format!("pubsub: {e}"))?;
                let plan = SetupPlan {
                    request_topic: format!("{QUEUE}-requests"),
                    subscription: format!("{QUEUE}-work"),
                    // Storms nack and retry: nothing may end as a dead letter.
                    dead_letter_topic: None,
                    max_delivery_attempts: crate::queue::pubsub::DEFAULT_MAX_DELIVERY_ATTEMPTS,
                    min_backoff: Duration::from_secs(1),
                    max_backoff: Duration::from_secs(2),
                    ack_deadline_secs: 10,
                    exactly_once: false,
                    result_topic: RESULTS.to_owned(),
                    result_subscription: Some(format!("{RESULTS}-sub")),
                };
                setup(&client, &plan)
                    .await
                    .map_err(|e| format!("pubsub setup: {e}"))?;
                Ok(Self::PubSub {
                    emulator,
                    client,
                    plan,
                })
            }
        }
    }

    /// What the transport is called in the account.
    pub(super) fn label(&self) -> &'static str {
        match self {
            Self::Redis { .. } => "Redis",
            Self::Sql { .. } => "PostgreSQL (sql)",
            Self::PubSub { .. } => "Pub/Sub (emulator)",
        }
    }

    /// Enqueues `bench-0` … `bench-<messages − 1>`.
    pub(super) async fn enqueue(&self, messages: usize, max_tokens: u32) -> Result<(), String> {
        let client: Box<dyn Client> = match self {
            Self::Redis { conn, .. } => {
                Box::new(RedisClient::new(conn.clone(), QUEUE.to_owned(), None, None))
            }
            Self::Sql { client, .. } => Box::new(SqlQueueClient::new(
                client.clone(),
                QUEUE.to_owned(),
                RESULTS.to_owned(),
            )),
            Self::PubSub { client, plan, .. } => Box::new(PubSubClient::new(
                client,
                Some(plan.request_topic.clone()),
                None,
            )),
        };
        let deadline = crate::clock::unix_secs() + 24 * 3600;
        for start in (0..messages).step_by(CHUNK) {
            let ids = start..(start + CHUNK).min(messages);
            (client
                .enqueue(bench_requests(ids, deadline, max_tokens), None)
                .await)
                .map_err(|e| format!("enqueue: {e}"))?;
        }
        Ok(())
    }

    /// Points a replica's command (set up for Redis) at this transport.
    pub(super) fn configure(&self, cmd: &mut Command) {
        match self {
            Self::Redis { .. } => {}
            Self::Sql { url, .. } => {
                cmd.env("SLUICEGATE_TRANSPORT", "sql")
                    .env("SLUICEGATE_SQL_URL", url)
                    .env("SLUICEGATE_SQL_POLL_INTERVAL", "100ms");
            }
            Self::PubSub { emulator, plan, .. } => {
                cmd.env("SLUICEGATE_TRANSPORT", "pubsub")
                    .env("SLUICEGATE_QUEUE", &plan.subscription)
                    .env_remove("SLUICEGATE_QUEUE_RESULT_QUEUE_NAME")
                    .env("SLUICEGATE_PUBSUB_PROJECT_ID", PROJECT)
                    .env("SLUICEGATE_PUBSUB_RESULT_TOPIC_ID", &plan.result_topic)
                    .env("SLUICEGATE_PUBSUB_EMULATOR_HOST", emulator.host());
            }
        }
    }

    /// Reads the results written since the last call into `tally`. While
    /// the server is down it reads nothing (and says nothing: the stall
    /// check notices a store that never comes back).
    pub(super) async fn read_new(&mut self, tally: &mut Tally) {
        match self {
            // Results are LPUSHed: counted from the tail, an entry keeps
            // its position however many come after it.
            Self::Redis { conn, read } => loop {
                let chunk: Result<Vec<Vec<u8>>, _> = redis::cmd("LRANGE")
                    .arg(RESULTS)
                    .arg(-(*read + 10_000))
                    .arg(-(*read + 1))
                    .query_async(conn)
                    .await;
                let Ok(chunk) = chunk else { return };
                if chunk.is_empty() {
                    return;
                }
                *read += chunk.len() as isize;
                for text in chunk {
                    tally.record_json(&text);
                }
            },
            // A plain cursor: the reader holds back at a position a
            // result may still commit to (the soak checks it does).
            Self::Sql { client, after, .. } => loop {
                let Ok(rows) = client.results_after(RESULTS, *after, 10_000).await else {
                    return;
                };
                let Some(last) = rows.last() else { return };
                *after = last.seq;
                for row in &rows {
                    tally.record(Some(&row.id));
                }
                if rows.len() < 10_000 {
                    return;
                }
            },
            Self::PubSub { client, plan, .. } => {
                let Some(name) = &plan.result_subscription else {
                    return;
                };
                while let Some(n) = pull_now(client, name, tally).await
                    && n > 0
                {}
            }
        }
    }

    /// SIGKILLs the store's server and starts it again (see the module
    /// comment for which server that is).
    pub(super) async fn restart(&mut self, redis: &mut RedisServer) -> Result<(), String> {
        match self {
            Self::Redis { .. } | Self::PubSub { .. } => redis.restart().await,
            Self::Sql { server, .. } => tokio::task::block_in_place(|| {
                server.kill()?;
                std::thread::sleep(Duration::from_secs(1));
                server.run()
            }),
        }
    }
}

/// One pull of the result subscription that answers at once (a waiting
/// pull abandoned would swallow results until their ack deadline,
/// docs/transports.md), each result counted and acked; how many, or
/// `None` on an error.
async fn pull_now(
    client: &gcloud_pubsub::client::Client,
    subscription: &str,
    tally: &mut Tally,
) -> Option<usize> {
    let sub = client.subscription(subscription);
    #[allow(deprecated)]
    let request = gcloud_googleapis::pubsub::v1::PullRequest {
        subscription: sub.fully_qualified_name().to_owned(),
        return_immediately: true,
        max_messages: 1000,
    };
    let pulled = sub.get_client().pull(request, None).await.ok()?;
    let pulled = pulled.into_inner().received_messages;
    let ack_ids: Vec<String> = pulled.iter().map(|m| m.ack_id.clone()).collect();
    // Counted only once acked: a result whose ack failed comes again.
    sub.ack(ack_ids).await.ok()?;
    for m in &pulled {
        if let Some(message) = &m.message {
            tally.record_json(&message.data);
        }
    }
    Some(pulled.len())
}
