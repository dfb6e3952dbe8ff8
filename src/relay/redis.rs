//! The relay across processes: a Redis Stream per streamed flex request,
//! `<queue>:flex-stream:<id>` (on a cluster `{<queue>}:flex-stream:<id>`,
//! in the queue's own slot, as every key of the queue is), kept
//! [`STREAM_TTL`] after its last write.
//!
//! Why a Stream and not Pub/Sub: a holder that starts reading late (its
//! reader was between two reads when the first piece came) still finds
//! every piece from the start, in order, with no subscription to be in
//! place first; and a Stream is a plain key, so it routes on a cluster.
//! Why the queue's keys and not `serve.key_prefix`: the writer is a
//! dispatcher, maybe a `sluicegate run` that never reads `[serve]`; the
//! queue's name is what both sides know, and on a cluster it puts every
//! stream of the queue in one slot, so one `XREAD` reads them all.
//!
//! Writer ([`RedisRelay::writer`]): one task per relayed attempt that
//! drains its channel in order, each round trip a pipeline of the `XADD`s
//! waiting plus one `PEXPIRE` (pieces coalesce while a write is out, so a
//! fast engine costs round trips, not one per token). A failed write is
//! logged and dropped: the holder stalls and the record completes it.
//!
//! Reader ([`read_loop`]): one per `serve`, on a connection of its own,
//! because `XREAD BLOCK` holds its connection until data comes or the
//! block ends (on the shared multiplexed connection it would delay every
//! other command; `crate::redis` blocks nowhere else). It reads the
//! streams of every id held here, from where it left each, blocking up to
//! [`BLOCK`]: a new id's first piece waits at most that long, later ones
//! come as they are written. A stream no longer held is deleted.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Event;
use super::local::LocalRelay;
use crate::redis::{RedisConnection, hash_tag};

/// How long a request's stream is kept after its last write: a holder
/// reads it within seconds; this only bounds what an abandoned one costs.
pub const STREAM_TTL: Duration = Duration::from_secs(600);
/// Longest one `XREAD` blocks.
const BLOCK: Duration = Duration::from_millis(200);
/// Most entries one `XREAD` returns per stream.
const READ_COUNT: usize = 512;
/// Pause after a failed read.
const RETRY_AFTER: Duration = Duration::from_millis(250);

/// The stream key of request `id` on queue `queue`.
pub fn stream_key(queue: &str, cluster: bool, id: &str) -> String {
    if cluster && hash_tag(queue).is_none() {
        format!("{{{queue}}}:flex-stream:{id}")
    } else {
        format!("{queue}:flex-stream:{id}")
    }
}

/// Writes relayed events of one queue's requests. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RedisRelay {
    conn: RedisConnection,
    queue: String,
}

impl RedisRelay {
    /// Streams of `queue` on `conn`.
    pub fn new(conn: RedisConnection, queue: impl Into<String>) -> Self {
        Self {
            conn,
            queue: queue.into(),
        }
    }

    /// A channel whose events go to `id`'s stream, in order; its task
    /// ends when the channel's senders are gone and everything is written.
    pub fn writer(&self, id: &str) -> mpsc::UnboundedSender<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        let key = stream_key(&self.queue, self.conn.is_cluster(), id);
        tokio::spawn(write_all(self.conn.clone(), key, rx));
        tx
    }
}

async fn write_all(mut conn: RedisConnection, key: String, mut rx: mpsc::UnboundedReceiver<Event>) {
    let ttl = u64::try_from(STREAM_TTL.as_millis()).unwrap_or(u64::MAX);
    while let Some(first) = rx.recv().await {
        let mut pipe = redis::pipe();
        let mut event = Some(first);
        while let Some(e) = event {
            let cmd = pipe.cmd("XADD").arg(&key).arg("*");
            match e {
                Event::Chunk { attempt, seq, data } => {
                    cmd.arg("k")
                        .arg("c")
                        .arg("a")
                        .arg(attempt)
                        .arg("s")
                        .arg(seq);
                    cmd.arg("d").arg(data.as_ref());
                }
                Event::End {
                    attempt,
                    chunks,
                    error,
                } => {
                    cmd.arg("k")
                        .arg("e")
                        .arg("a")
                        .arg(attempt)
                        .arg("n")
                        .arg(chunks);
                    if let Some(error) = error {
                        cmd.arg("d").arg(error);
                    }
                }
            }
            cmd.ignore();
            event = rx.try_recv().ok();
        }
        pipe.cmd("PEXPIRE").arg(&key).arg(ttl).ignore();
        if let Err(error) = pipe.query_async::<()>(&mut conn).await {
            tracing::debug!(%key, %error, "stream relay write failed; the record completes the stream");
        }
    }
}

/// Reads the streams of every id `relay` holds into their routes, until
/// `stop` (see the module docs).
pub async fn read_loop(
    relay: Arc<LocalRelay>,
    mut conn: RedisConnection,
    queue: String,
    stop: CancellationToken,
) {
    let cluster = conn.is_cluster();
    // Per held id: the last entry read.
    let mut last: HashMap<String, String> = HashMap::new();
    loop {
        let ids = relay.ids();
        let gone: Vec<String> = (last.keys())
            .filter(|id| !ids.contains(id))
            .cloned()
            .collect();
        if !gone.is_empty() {
            let mut pipe = redis::pipe();
            for id in &gone {
                last.remove(id);
                pipe.cmd("DEL")
                    .arg(stream_key(&queue, cluster, id))
                    .ignore();
            }
            if let Err(error) = pipe.query_async::<()>(&mut conn).await {
                tracing::debug!(%error, "cannot delete finished relay streams; they expire");
            }
        }
        if ids.is_empty() {
            tokio::select! {
                () = stop.cancelled() => return,
                () = relay.added() => continue,
            }
        }
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(READ_COUNT)
            .arg("BLOCK")
            .arg(u64::try_from(BLOCK.as_millis()).unwrap_or(200))
            .arg("STREAMS");
        let mut by_key = HashMap::with_capacity(ids.len());
        for id in &ids {
            let key = stream_key(&queue, cluster, id);
            cmd.arg(&key);
            by_key.insert(key, id.clone());
        }
        for id in &ids {
            cmd.arg(
                last.entry(id.clone())
                    .or_insert_with(|| "0-0".to_owned())
                    .as_str(),
            );
        }
        let reply = tokio::select! {
            () = stop.cancelled() => return,
            reply = cmd.query_async::<Value>(&mut conn) => reply,
        };
        let reply = match reply {
            Ok(reply) => reply,
            Err(error) => {
                tracing::debug!(%error, "stream relay read failed");
                if !crate::tasks::sleep_unless(&stop, RETRY_AFTER).await {
                    return;
                }
                continue;
            }
        };
        for (key, entries) in streams_of(reply) {
            let Some(id) = by_key.get(&key) else {
                continue;
            };
            let tx = relay.sender(id);
            for (entry, fields) in entries {
                last.insert(id.clone(), entry);
                if let (Some(tx), Some(event)) = (&tx, decode(&fields)) {
                    let _ = tx.send(event);
                }
            }
        }
    }
}

/// An entry's fields as an event; `None` when it is not one of ours.
fn decode(fields: &HashMap<String, Vec<u8>>) -> Option<Event> {
    let number =
        |name: &str| -> Option<u64> { std::str::from_utf8(fields.get(name)?).ok()?.parse().ok() };
    let attempt = number("a")?;
    match fields.get("k").map(Vec::as_slice) {
        Some(b"c") => Some(Event::Chunk {
            attempt,
            seq: number("s")?,
            data: Bytes::copy_from_slice(fields.get("d")?),
        }),
        Some(b"e") => Some(Event::End {
            attempt,
            chunks: number("n")?,
            error: fields
                .get("d")
                .map(|d| String::from_utf8_lossy(d).into_owned()),
        }),
        _ => None,
    }
}

/// `XREAD`'s reply (RESP2 arrays or RESP3 maps) as streams of entries,
/// each its id and its fields.
#[allow(clippy::type_complexity)]
fn streams_of(reply: Value) -> Vec<(String, Vec<(String, HashMap<String, Vec<u8>>)>)> {
    let pairs: Vec<(Value, Value)> = match reply {
        Value::Array(items) => items
            .into_iter()
            .filter_map(|item| match item {
                Value::Array(mut kv) if kv.len() == 2 => {
                    let entries = kv.pop()?;
                    Some((kv.pop()?, entries))
                }
                _ => None,
            })
            .collect(),
        Value::Map(pairs) => pairs,
        _ => return Vec::new(),
    };
    pairs
        .into_iter()
        .filter_map(|(key, entries)| {
            let key = text(&key)?;
            let Value::Array(entries) = entries else {
                return None;
            };
            let entries = entries
                .into_iter()
                .filter_map(|entry| {
                    let Value::Array(mut parts) = entry else {
                        return None;
                    };
                    if parts.len() != 2 {
                        return None;
                    }
                    let fields = parts.pop()?;
                    let id = text(&parts.pop()?)?;
                    Some((id, fields_of(fields)))
                })
                .collect();
            Some((key, entries))
        })
        .collect()
}

fn fields_of(value: Value) -> HashMap<String, Vec<u8>> {
    let flat: Vec<Value> = match value {
        Value::Array(items) => items,
        Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => Vec::new(),
    };
    let mut fields = HashMap::new();
    let mut items = flat.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        if let (Some(name), Some(value)) = (text(&name), bytes_of(value)) {
            fields.insert(name, value);
        }
    }
    fields
}

fn bytes_of(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(text) => Some(text.into_bytes()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_keys_stay_in_the_queues_slot() {
        assert_eq!(stream_key("q", false, "flex_1"), "q:flex-stream:flex_1");
        assert_eq!(stream_key("q", true, "flex_1"), "{q}:flex-stream:flex_1");
        assert_eq!(
            stream_key("{t}q", true, "flex_1"),
            "{t}q:flex-stream:flex_1"
        );
        assert_eq!(
            crate::redis::key_slot(&stream_key("q", true, "x")),
            crate::redis::key_slot("{q}:claimed")
        );
    }

    #[test]
    fn an_xread_reply_decodes_into_events() {
        let bulk = |s: &[u8]| Value::BulkString(s.to_vec());
        let entry = |id: &str, fields: Vec<Value>| {
            Value::Array(vec![bulk(id.as_bytes()), Value::Array(fields)])
        };
        let reply = Value::Array(vec![Value::Array(vec![
            bulk(b"q:flex-stream:flex_1"),
            Value::Array(vec![
                entry(
                    "1-0",
                    vec![
                        bulk(b"k"),
                        bulk(b"c"),
                        bulk(b"a"),
                        bulk(b"9"),
                        bulk(b"s"),
                        bulk(b"0"),
                        bulk(b"d"),
                        bulk(b"data: x\n\n"),
                    ],
                ),
                entry(
                    "1-1",
                    vec![
                        bulk(b"k"),
                        bulk(b"e"),
                        bulk(b"a"),
                        bulk(b"9"),
                        bulk(b"n"),
                        bulk(b"1"),
                    ],
                ),
            ]),
        ])]);
        let streams = streams_of(reply);
        assert_eq!(streams.len(), 1);
        let (key, entries) = &streams[0];
        assert_eq!(key, "q:flex-stream:flex_1");
        let events: Vec<_> = entries.iter().filter_map(|(_, f)| decode(f)).collect();
        assert_eq!(
            events,
            vec![
                Event::Chunk {
                    attempt: 9,
                    seq: 0,
                    data: Bytes::from_static(b"data: x\n\n")
                },
                Event::End {
                    attempt: 9,
                    chunks: 1,
                    error: None
                },
            ]
        );
        assert_eq!(entries[1].0, "1-1");
        assert!(streams_of(Value::Nil).is_empty(), "a block that timed out");
    }
}
