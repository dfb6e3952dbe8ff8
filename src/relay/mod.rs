//! The stream relay: a streamed flex request's (`stream: true`) event
//! stream, carried from the dispatcher that reads it from the engine to
//! the `serve` connection that holds the client, as it arrives
//! (`docs/flex.md`, "Streaming").
//!
//! The result record still goes through the result queue whole, as for
//! every message: it is the source of truth (at-least-once, durable). The
//! relay is a best-effort fast path beside it, never durable: what it
//! loses, the record makes good (the holder sends the part of the
//! record's payload the client has not had yet).
//!
//! Two carriers, one event shape ([`Event`]):
//!
//! - in process ([`local::LocalRelay`]): a registry of channels keyed by
//!   message id, which `serve` subscribes to before enqueuing; a
//!   dispatcher in the same process that finds the id there sends into the
//!   channel directly (no copy leaves the process), and sees the holder
//!   go away at once (the client left: it aborts the attempt without
//!   waiting for the cancel watcher);
//! - across processes ([`redis`]): a Redis Stream per request under the
//!   queue's keys (`<queue>:flex-stream:<id>`, `{queue}`-tagged on a
//!   cluster), written with `XADD` by whichever dispatcher sends it and
//!   read by the holding `serve` with `XREAD BLOCK` on a connection of its
//!   own, into the same registry.
//!
//! This file: the events, the framing of relayed bytes into whole
//! server-sent events ([`SseFramer`]), and the rule the holder follows
//! ([`Follow`]: order, duplicates, retries, the record's reconciliation).
//! All pure.

pub mod local;
pub mod redis;

use std::sync::Arc;

use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::gateway::BodyTap;
use crate::request::Request;

use self::local::LocalRelay;
use self::redis::RedisRelay;

/// One relayed event of one attempt. `attempt` is random per attempt, so
/// a holder tells a second attempt (a redelivery after a dispatcher died
/// mid-stream) from the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Whole server-sent events, the `seq`-th piece (from 0) of the attempt.
    Chunk {
        /// The attempt's token.
        attempt: u64,
        /// Its place in the attempt's pieces.
        seq: u64,
        /// The bytes, ending on an event boundary.
        data: Bytes,
    },
    /// The attempt's stream ended after `chunks` pieces: complete, or
    /// broken with `error` (no second attempt follows a broken one: the
    /// dispatcher does not retry once it relayed anything).
    End {
        /// The attempt's token.
        attempt: u64,
        /// Pieces relayed.
        chunks: u64,
        /// Why it broke; `None` when the engine's stream ended.
        error: Option<String>,
    },
}

/// Whether a queue message id is a flex request's: `serve` names them
/// `flex_…` (`serve::flex`). Here, below both, so a dispatcher can tell
/// without importing `serve`.
pub fn is_flex_id(id: &str) -> bool {
    id.starts_with("flex_")
}

/// Where a dispatcher relays its streamed flex requests: the holders in
/// its own process, then (Redis transport) the queue's streams. Off (the
/// default) relays nothing: every answer goes whole through the record.
#[derive(Debug, Clone, Default)]
pub struct Relay {
    local: Option<Arc<LocalRelay>>,
    redis: Option<RedisRelay>,
}

/// The part of a body the relay reads: only `stream`.
#[derive(Deserialize)]
struct Streamed {
    #[serde(default)]
    stream: Option<bool>,
}

impl Relay {
    /// Relays to `local` holders, and to `redis` streams for the others.
    pub fn new(local: Option<Arc<LocalRelay>>, redis: Option<RedisRelay>) -> Self {
        Self { local, redis }
    }

    /// With `local` holders too (a `serve` with its dispatcher in process).
    pub fn with_local(mut self, local: Arc<LocalRelay>) -> Self {
        self.local = Some(local);
        self
    }

    /// The outlet of one attempt of `request`, when it is a streamed flex
    /// request and someone may hold it: a holder in this process gets it
    /// directly, else it goes to Redis (whoever holds it reads there).
    /// Any other request (every batch line) costs one prefix check.
    pub fn open(&self, request: &Request) -> Option<Outlet> {
        if (self.local.is_none() && self.redis.is_none()) || !is_flex_id(&request.id) {
            return None;
        }
        let streamed = serde_json::from_str::<Streamed>(request.payload.get())
            .ok()
            .and_then(|s| s.stream)
            == Some(true);
        if !streamed {
            return None;
        }
        let (tx, local) = match self.local.as_ref().and_then(|l| l.sender(&request.id)) {
            Some(tx) => (tx, true),
            None => (self.redis.as_ref()?.writer(&request.id), false),
        };
        Some(Outlet {
            tx,
            local,
            framer: SseFramer::default(),
            attempt: rand::random(),
            seq: 0,
        })
    }
}

/// One attempt's relay: the gateway client's tap on its body.
#[derive(Debug)]
pub struct Outlet {
    tx: mpsc::UnboundedSender<Event>,
    /// The holder is in this process (its going away is seen at once).
    local: bool,
    framer: SseFramer,
    attempt: u64,
    seq: u64,
}

impl BodyTap for Outlet {
    fn bytes(&mut self, bytes: &[u8]) {
        if let Some(events) = self.framer.push(bytes) {
            let event = Event::Chunk {
                attempt: self.attempt,
                seq: self.seq,
                data: Bytes::from(events),
            };
            self.seq += 1;
            // A holder gone: the attempt is stopped by `holder_gone` (in
            // process) or the cancel watcher.
            let _ = self.tx.send(event);
        }
    }
}

impl Outlet {
    /// Whether any piece went out: the client's stream has begun, and no
    /// other attempt may follow this one.
    pub fn started(&self) -> bool {
        self.seq > 0
    }

    /// Resolves when a holder in this process went away (its client
    /// left); never for one elsewhere, whose cancel the queue carries.
    pub fn holder_gone(&self) -> impl Future<Output = ()> + Send + 'static {
        let watch = self.local.then(|| self.tx.clone());
        async move {
            match watch {
                Some(tx) => tx.closed().await,
                None => std::future::pending().await,
            }
        }
    }

    /// Ends the attempt's stream: complete, or broken with `error`. An
    /// attempt that relayed nothing sends nothing (its holder waits for
    /// the next attempt, or the record).
    pub fn end(self, error: Option<String>) {
        if self.started() {
            let _ = self.tx.send(Event::End {
                attempt: self.attempt,
                chunks: self.seq,
                error,
            });
        }
    }
}

/// Cuts relayed bytes at server-sent event boundaries (a blank line), so
/// a holder that has to end the client's stream early with an error event
/// writes it after a whole event, never inside one.
#[derive(Debug, Default)]
pub struct SseFramer {
    pending: Vec<u8>,
}

impl SseFramer {
    /// Takes `bytes`; returns the whole events they complete, if any. The
    /// tail after the last boundary waits for more.
    pub fn push(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        // Only the new bytes (and the three before, a boundary may
        // straddle the two) can hold a new boundary.
        let from = self.pending.len().saturating_sub(3);
        self.pending.extend_from_slice(bytes);
        let end = last_boundary(&self.pending[from..])? + from;
        let rest = self.pending.split_off(end);
        Some(std::mem::replace(&mut self.pending, rest))
    }
}

/// The end (exclusive) of the last blank line in `bytes`: `\n\n` or
/// `\n\r\n` (a CRLF stream).
fn last_boundary(bytes: &[u8]) -> Option<usize> {
    let mut at = bytes.len();
    while at >= 2 {
        if bytes[at - 1] == b'\n' {
            if bytes[at - 2] == b'\n' {
                return Some(at);
            }
            if at >= 3 && bytes[at - 2] == b'\r' && bytes[at - 3] == b'\n' {
                return Some(at);
            }
        }
        at -= 1;
    }
    None
}

/// What the holder does with one event or the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Write these bytes to the client.
    Send(Bytes),
    /// Nothing (a duplicate, an attempt that relayed nothing).
    Skip,
    /// The relay missed something: write nothing more from it and wait
    /// for the record, which completes the stream.
    Stall,
    /// Write these bytes (maybe none), then end the stream: it is complete.
    Finish(Bytes),
    /// End the client's stream with an error event with this message.
    Fail(String),
}

/// The holder's rule for one streamed request:
///
/// - the first attempt whose first piece (`seq` 0) arrives is followed;
///   its pieces are written in `seq` order, a repeat is skipped, a gap
///   stalls the relay (the record fills it);
/// - a piece of *another* attempt once one is followed means the request
///   was sent again after its answer began (a dispatcher died
///   mid-stream): two answers must not be spliced, the stream fails;
/// - the followed attempt's end completes the stream when every piece
///   was written, fails it when it broke;
/// - the record, whenever it comes first: its payload is the whole
///   answer; the part after what was written is sent and the stream ends,
///   provided what was written is its beginning (the same attempt), else
///   the stream fails.
#[derive(Debug, Default)]
pub struct Follow {
    attempt: Option<u64>,
    next: u64,
    stalled: bool,
    /// What was written, to check the record begins with it.
    written: Vec<u8>,
}

impl Follow {
    /// Whether anything was written to the client.
    pub fn started(&self) -> bool {
        !self.written.is_empty()
    }

    /// The step for a relayed event.
    pub fn event(&mut self, event: Event) -> Step {
        match event {
            Event::Chunk { attempt, seq, data } => {
                match self.attempt {
                    None if seq == 0 => self.attempt = Some(attempt),
                    // Its beginning was missed: only the record can say it.
                    None => return self.stall(),
                    Some(a) if a != attempt => {
                        return Step::Fail(
                            "the request was sent again after its answer began streaming; the stream cannot go on"
                                .into(),
                        );
                    }
                    Some(_) => {}
                }
                if self.stalled || seq < self.next {
                    return Step::Skip;
                }
                if seq > self.next {
                    return self.stall();
                }
                self.next += 1;
                self.written.extend_from_slice(&data);
                Step::Send(data)
            }
            Event::End {
                attempt,
                chunks,
                error,
            } => match self.attempt {
                Some(a) if a == attempt => match error {
                    Some(error) => Step::Fail(error),
                    None if !self.stalled && self.next == chunks => Step::Finish(Bytes::new()),
                    None => self.stall(),
                },
                // The end of an attempt whose pieces never came here.
                None if chunks > 0 => self.stall(),
                _ => Step::Skip,
            },
        }
    }

    fn stall(&mut self) -> Step {
        self.stalled = true;
        Step::Stall
    }

    /// The step for the request's record: `success` when it carries a 2xx
    /// answer whose body is `payload`; `error` is its message otherwise.
    pub fn record(&mut self, success: bool, payload: &str, error: &str) -> Step {
        if success && payload.as_bytes().starts_with(&self.written) {
            let rest = Bytes::copy_from_slice(&payload.as_bytes()[self.written.len()..]);
            return Step::Finish(rest);
        }
        if success {
            return Step::Fail(
                "the request's answer differs from the part already streamed (it was sent again)"
                    .into(),
            );
        }
        Step::Fail(error.to_owned())
    }
}

/// An error event in OpenAI's shape, the last event of a stream that
/// cannot complete (the `openai` clients raise it as an `APIError`).
pub fn error_event(message: &str) -> Bytes {
    let body = serde_json::json!({"error": {
        "message": message, "type": "server_error", "param": null, "code": "stream_interrupted",
    }});
    Bytes::from(format!("data: {body}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(attempt: u64, seq: u64, text: &str) -> Event {
        Event::Chunk {
            attempt,
            seq,
            data: Bytes::copy_from_slice(text.as_bytes()),
        }
    }

    fn end(attempt: u64, chunks: u64) -> Event {
        Event::End {
            attempt,
            chunks,
            error: None,
        }
    }

    #[test]
    fn the_framer_cuts_at_event_boundaries_across_any_split() {
        let wire = b"data: a\n\ndata: b\r\n\r\ndata: [DONE]\n\n";
        for split in 0..wire.len() {
            let mut framer = SseFramer::default();
            let mut out = Vec::new();
            for part in [&wire[..split], &wire[split..]] {
                if let Some(events) = framer.push(part) {
                    assert!(
                        events.ends_with(b"\n\n") || events.ends_with(b"\n\r\n"),
                        "split at {split}"
                    );
                    out.extend_from_slice(&events);
                }
            }
            assert_eq!(out, wire, "split at {split}");
        }
        let mut framer = SseFramer::default();
        assert_eq!(framer.push(b"data: half"), None);
        assert_eq!(framer.push(b" more\n"), None);
        assert_eq!(
            framer.push(b"\ndata: next"),
            Some(b"data: half more\n\n".to_vec())
        );
    }

    #[test]
    fn pieces_are_written_in_order_once_and_the_end_completes() {
        let mut follow = Follow::default();
        assert_eq!(follow.event(chunk(7, 0, "a")), Step::Send("a".into()));
        assert_eq!(follow.event(chunk(7, 0, "a")), Step::Skip, "a repeat");
        assert_eq!(follow.event(chunk(7, 1, "b")), Step::Send("b".into()));
        assert_eq!(follow.event(end(7, 2)), Step::Finish(Bytes::new()));
        assert!(follow.started());
    }

    #[test]
    fn a_gap_stalls_and_the_record_fills_it() {
        let mut follow = Follow::default();
        assert_eq!(follow.event(chunk(7, 0, "a")), Step::Send("a".into()));
        assert_eq!(follow.event(chunk(7, 2, "c")), Step::Stall);
        assert_eq!(follow.event(chunk(7, 3, "d")), Step::Skip);
        assert_eq!(follow.event(end(7, 4)), Step::Stall);
        assert_eq!(follow.record(true, "abcd", ""), Step::Finish("bcd".into()));
        // A missed beginning stalls too.
        let mut late = Follow::default();
        assert_eq!(late.event(chunk(7, 1, "b")), Step::Stall);
        assert_eq!(late.record(true, "ab", ""), Step::Finish("ab".into()));
    }

    #[test]
    fn a_second_attempt_after_the_stream_began_fails_it() {
        let mut follow = Follow::default();
        assert_eq!(follow.event(chunk(1, 0, "a")), Step::Send("a".into()));
        assert!(matches!(follow.event(chunk(2, 0, "x")), Step::Fail(_)));
        // The record of another attempt does not continue the first's.
        let mut other = Follow::default();
        other.event(chunk(1, 0, "a"));
        assert!(matches!(other.record(true, "xyz", ""), Step::Fail(_)));
    }

    #[test]
    fn attempts_that_relayed_nothing_are_skipped_and_a_broken_one_fails() {
        let mut follow = Follow::default();
        assert_eq!(follow.event(end(1, 0)), Step::Skip);
        assert_eq!(follow.event(chunk(2, 0, "a")), Step::Send("a".into()));
        let broken = Event::End {
            attempt: 2,
            chunks: 1,
            error: Some("reset".into()),
        };
        assert_eq!(follow.event(broken), Step::Fail("reset".into()));
        // Nothing relayed: the record is the whole answer.
        let mut whole = Follow::default();
        assert_eq!(whole.record(true, "all", ""), Step::Finish("all".into()));
        assert_eq!(
            Follow::default().record(false, "", "no answer"),
            Step::Fail("no answer".into())
        );
    }

    #[test]
    fn the_error_event_is_an_openai_error_object() {
        let text = String::from_utf8(error_event("broke").to_vec()).expect("utf-8");
        let json: serde_json::Value =
            serde_json::from_str(text.trim().strip_prefix("data: ").expect("data")).expect("json");
        assert_eq!(json["error"]["message"], "broke");
        assert!(text.ends_with("\n\n"));
    }
}
