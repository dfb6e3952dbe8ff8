//! Deliveries this process holds, and what a hand-back does to each: the
//! bookkeeping and decisions of the Pub/Sub transport's holds, with no I/O
//! (`mod.rs` sends the RPCs), so every rule is unit-tested here.
//!
//! Why holds exist (issue 22): Pub/Sub counts every redelivery as a
//! delivery attempt, whatever the reason, and the emulator on a
//! subscription with a retry policy stopped redelivering a message after
//! three nacks sent as `ModifyAckDeadline(2 s)`. A dispatcher that nacked
//! while it waited out a 429/503 storm or a closed gate therefore either
//! burned the message's attempts (dead-lettered without a result) or lost
//! it in the broker. So waiting never goes through the broker: a message
//! handed back for congestion or a gate keeps its lease (the transport
//! extends its ack deadline) and is handed out again by this process when
//! its delay ends. Only a failed attempt (which should count) and what a
//! budget no longer covers go back to the broker, as `ModifyAckDeadline 0`,
//! the one nack form both the emulator and the service redeliver.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::message::Received;
use super::seen::{Answered, MessageKey};
use crate::queue::NackReason;

/// Bounds of what the transport holds for the pool (`[pubsub] max_hold`,
/// `max_hold_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Budget {
    /// Longest a delivery is kept leased by extensions, counted from its
    /// Pull; then it goes back to the broker.
    pub(super) max_hold: Duration,
    /// Most message bytes on hold at once; a hold beyond it goes back to
    /// the broker instead.
    pub(super) max_bytes: u64,
}

/// What happens when a hold ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Then {
    /// Handed out again by this process's next receive (waiting for the
    /// pool: no delivery attempt is used).
    Redeliver,
    /// Handed back to the broker (`ModifyAckDeadline 0`): a failed attempt
    /// whose backoff ended; the broker counts the redelivery.
    HandBack,
}

/// What to do with a delivery the dispatcher hands back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// Keep it leased until `until`, then `then`.
    Hold {
        /// When the hold ends.
        until: Instant,
        /// What happens then.
        then: Then,
    },
    /// Back to the broker now (`ModifyAckDeadline 0`).
    HandBack,
    /// Its last delivery before the broker dead-letters it: the transport
    /// answers it (an error result) and dead-letters it itself, so it never
    /// reaches the dead-letter topic without a result.
    Answer,
}

/// What [`plan`] decides from.
#[derive(Debug, Clone, Copy)]
pub(super) struct Facts {
    /// Why the dispatcher hands it back.
    pub(super) reason: NackReason,
    /// The delay it asked for.
    pub(super) delay: Duration,
    /// Now.
    pub(super) now: Instant,
    /// When it was pulled (the hold budget counts from there).
    pub(super) pulled_at: Instant,
    /// Time left until the request's own deadline, if it has a readable one.
    pub(super) deadline_in: Option<Duration>,
    /// This is its last delivery (see [`last_delivery`]).
    pub(super) last_delivery: bool,
    /// Its size in bytes.
    pub(super) size: u64,
    /// Bytes already on hold (other deliveries).
    pub(super) held_bytes: u64,
}

/// Decides a hand-back (see the module docs):
/// - congestion and gate waits are held for their delay, bounded by the
///   request's deadline (a request whose deadline comes first is handed out
///   at the deadline, to be answered `DEADLINE_EXCEEDED`) and by the hold
///   budget; outside the budget they go back to the broker, or are answered
///   on their last delivery;
/// - a failed attempt is held for its backoff, then handed back to the
///   broker (the redelivery counts toward `max_delivery_attempts`, as a
///   failure should); on its last delivery it is answered at once;
/// - shutdown hands back at once, except a last delivery, which is
///   answered (handing it back would dead-letter it without a result).
pub(super) fn plan(f: &Facts, budget: &Budget) -> Plan {
    let hold_ends = f.pulled_at + budget.max_hold;
    let fits = f.now < hold_ends && f.held_bytes.saturating_add(f.size) <= budget.max_bytes;
    let by_deadline = |t: Instant| match f.deadline_in {
        Some(left) => t.min(f.now + left),
        None => t,
    };
    match f.reason {
        NackReason::Shutdown if f.last_delivery => Plan::Answer,
        NackReason::Shutdown => Plan::HandBack,
        NackReason::Failed if f.last_delivery => Plan::Answer,
        NackReason::Failed if f.delay.is_zero() || !fits => Plan::HandBack,
        NackReason::Failed => Plan::Hold {
            until: by_deadline(f.now + f.delay).min(hold_ends),
            then: Then::HandBack,
        },
        NackReason::Congested | NackReason::NotAdmitted if fits => Plan::Hold {
            until: by_deadline(f.now + f.delay).min(hold_ends),
            then: Then::Redeliver,
        },
        NackReason::Congested | NackReason::NotAdmitted if f.last_delivery => Plan::Answer,
        NackReason::Congested | NackReason::NotAdmitted => Plan::HandBack,
    }
}

/// Whether a delivery is the last the broker makes before it dead-letters
/// the message: its delivery attempt has reached the subscription's
/// `max_delivery_attempts`. Without a dead-letter policy there is neither a
/// count nor a limit, and no delivery is the last.
pub(super) fn last_delivery(
    delivery_attempt: Option<i32>,
    max_delivery_attempts: Option<i32>,
) -> bool {
    matches!((delivery_attempt, max_delivery_attempts), (Some(a), Some(m)) if m > 0 && a >= m)
}

/// A request deadline (Unix seconds) as time left from `now_unix`; zero
/// when it has passed.
pub(super) fn time_left(deadline_unix: Option<i64>, now_unix: i64) -> Option<Duration> {
    deadline_unix
        .map(|d| Duration::from_secs(u64::try_from(d.saturating_sub(now_unix)).unwrap_or(0)))
}

/// One delivery this process holds.
#[derive(Debug)]
pub(super) struct Held {
    /// The broker's ack id for this delivery; `None` once the broker handed
    /// the same ack id to another delivery (the emulator numbers ack ids
    /// from 1 again after a restart), when this lease is void: acking or
    /// extending it would act on the other delivery's message.
    pub(super) ack_id: Option<String>,
    /// What the transport kept of the message.
    pub(super) info: Received,
    /// The broker's message id.
    pub(super) message_id: String,
    /// Ack ids of later deliveries of the same message that came while
    /// this one was held (issue 36): never handed to the dispatcher, acked,
    /// extended and handed back with this lease.
    pub(super) joined: Vec<String>,
    /// Its result is confirmed on the topic; only the ack is left (an ack
    /// retried after a failure must not publish a second result).
    pub(super) published: bool,
    /// When it was pulled.
    pub(super) pulled_at: Instant,
    /// When its ack deadline was last set or extended (by the pull, the
    /// dispatcher's lease renewal or the keeper).
    pub(super) extended_at: Instant,
    /// The retry count handed to the dispatcher (again on a redelivery
    /// from a hold).
    pub(super) retry_count: u32,
    /// Pub/Sub's delivery attempt, when the subscription counts them.
    pub(super) delivery_attempt: Option<i32>,
    /// On hold (not with the dispatcher), when it is.
    pub(super) hold: Option<OnHold>,
}

/// A hold in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OnHold {
    /// When it ends.
    pub(super) until: Instant,
    /// What happens then.
    pub(super) then: Then,
}

/// Every delivery this process holds, by the tag it gave the dispatcher,
/// and the bytes on hold.
///
/// Why tags and not ack ids (issue 22): the emulator numbers ack ids from 1
/// again after a restart, so a delivery pulled after an outage could carry
/// the ack id of one still held from before it; keyed by ack id, the new
/// entry replaced the old, and the old one's completion then acked the new
/// message and dropped its result (32 ids lost in 3 of 9 restart runs).
#[derive(Debug, Default)]
pub(super) struct Leases {
    map: HashMap<String, Held>,
    /// Which tag holds each live ack id.
    by_ack: HashMap<String, String>,
    hold_bytes: u64,
    /// Tags handed out so far (the next tag's number).
    issued: u64,
    /// Which tag holds each message.
    by_message: HashMap<MessageKey, String>,
    /// Messages whose results this process confirmed on the topic.
    answered: Answered,
}

fn size(h: &Held) -> u64 {
    h.info.body.len() as u64
}

impl Held {
    /// The message this is a delivery of.
    pub(super) fn key(&self) -> MessageKey {
        MessageKey::new(&self.message_id, &self.info.body)
    }
}

/// What a pulled delivery is to this process ([`Leases::insert`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Taken {
    /// A message this process does not hold: the dispatcher gets it under
    /// this tag.
    New(String),
    /// Another delivery of a message held under this tag (the broker
    /// redelivered it while it is with the dispatcher or on hold): its ack
    /// id joins that lease, and the message is not sent twice.
    Joined(String),
    /// A delivery of a message this process already answered (its result
    /// is confirmed on the topic): ack it, never send it again.
    Answered,
}

impl Leases {
    /// Deliveries held (with the dispatcher or on hold).
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Bytes of the deliveries on hold.
    pub(super) fn hold_bytes(&self) -> u64 {
        self.hold_bytes
    }

    /// Records a pulled delivery ([`Taken`]). An ack id the broker hands
    /// out again voids it wherever this process held it (see
    /// [`Held::ack_id`]).
    pub(super) fn insert(&mut self, mut held: Held) -> Taken {
        if let Some(ack_id) = &held.ack_id {
            self.void(ack_id);
        }
        let key = held.key();
        if self.answered.contains(&key) {
            return Taken::Answered;
        }
        if let Some(tag) = self.by_message.get(&key).cloned()
            && let Some(first) = self.map.get_mut(&tag)
        {
            if let Some(ack_id) = held.ack_id.take() {
                self.by_ack.insert(ack_id.clone(), tag.clone());
                if first.ack_id.is_none() {
                    first.ack_id = Some(ack_id);
                } else {
                    first.joined.push(ack_id);
                }
            }
            return Taken::Joined(tag);
        }
        self.issued += 1;
        let tag = format!("d{}", self.issued);
        if let Some(ack_id) = &held.ack_id {
            self.by_ack.insert(ack_id.clone(), tag.clone());
        }
        self.by_message.insert(key, tag.clone());
        self.map.insert(tag.clone(), held);
        Taken::New(tag)
    }

    /// Forgets `ack_id` on the lease that had it: the broker handed it to
    /// another delivery, so acking or extending it there would act on the
    /// other delivery's message.
    fn void(&mut self, ack_id: &str) {
        let Some(old_tag) = self.by_ack.remove(ack_id) else {
            return;
        };
        if let Some(old) = self.map.get_mut(&old_tag) {
            if old.ack_id.as_deref() == Some(ack_id) {
                old.ack_id = None;
            }
            old.joined.retain(|a| a != ack_id);
        }
    }

    /// The live ack ids of `tags` (held, lease not void), in order, each
    /// with the ack ids joined to it.
    pub(super) fn ack_ids<'a>(&self, tags: impl IntoIterator<Item = &'a String>) -> Vec<String> {
        tags.into_iter()
            .filter_map(|t| self.map.get(t))
            .flat_map(|h| h.ack_id.iter().chain(&h.joined).cloned())
            .collect()
    }

    pub(super) fn get(&self, tag: &str) -> Option<&Held> {
        self.map.get(tag)
    }

    pub(super) fn get_mut(&mut self, tag: &str) -> Option<&mut Held> {
        self.map.get_mut(tag)
    }

    /// Every tag held, with its delivery.
    pub(super) fn ids(&self) -> impl Iterator<Item = (&String, &Held)> {
        self.map.iter()
    }

    /// Stops holding a delivery (acked, handed back, or its lease lost).
    /// One whose result is confirmed on the topic is remembered as
    /// answered, so a later delivery of its message is acked, not sent.
    pub(super) fn remove(&mut self, tag: &str) -> Option<Held> {
        let held = self.map.remove(tag)?;
        for ack_id in held.ack_id.iter().chain(&held.joined) {
            if self.by_ack.get(ack_id).is_some_and(|t| t == tag) {
                self.by_ack.remove(ack_id);
            }
        }
        let key = held.key();
        if self.by_message.get(&key).is_some_and(|t| t == tag) {
            self.by_message.remove(&key);
        }
        if held.published {
            self.answered.insert(key);
        }
        self.forget(&held);
        Some(held)
    }

    /// Records that the ack deadlines of `tags` were just extended.
    pub(super) fn mark_extended<'a>(
        &mut self,
        tags: impl IntoIterator<Item = &'a String>,
        now: Instant,
    ) {
        for tag in tags {
            if let Some(h) = self.map.get_mut(tag) {
                h.extended_at = now;
            }
        }
    }

    /// Of `tags`, those whose ack deadline was not extended within
    /// `recent`: what a renewal still has to extend.
    pub(super) fn not_extended_within<'a>(
        &self,
        tags: impl IntoIterator<Item = &'a String>,
        now: Instant,
        recent: Duration,
    ) -> Vec<String> {
        tags.into_iter()
            .filter(|t| {
                self.map
                    .get(*t)
                    .is_some_and(|h| now.saturating_duration_since(h.extended_at) >= recent)
            })
            .cloned()
            .collect()
    }

    fn forget(&mut self, held: &Held) {
        if held.hold.is_some() {
            self.hold_bytes = self.hold_bytes.saturating_sub(size(held));
        }
    }

    /// Puts a delivery on hold until `until`; false if it is not held.
    pub(super) fn start_hold(&mut self, tag: &str, until: Instant, then: Then) -> bool {
        let Some(held) = self.map.get_mut(tag) else {
            return false;
        };
        if held.hold.is_none() {
            self.hold_bytes = self.hold_bytes.saturating_add(size(held));
        }
        held.hold = Some(OnHold { until, then });
        true
    }

    /// Takes a delivery off hold for the keeper to end it; false when it
    /// is no longer on hold (a receive handed it out meanwhile: it is the
    /// dispatcher's again and must not be handed back under it).
    pub(super) fn take_hold(&mut self, tag: &str) -> bool {
        let Some(held) = self.map.get_mut(tag) else {
            return false;
        };
        if held.hold.take().is_none() {
            return false;
        }
        self.hold_bytes = self.hold_bytes.saturating_sub(size(held));
        true
    }

    /// Up to `max` held deliveries to hand out again (earliest hold end
    /// first), taken off hold: they go back to the dispatcher.
    pub(super) fn take_redeliveries(&mut self, now: Instant, max: usize) -> Vec<(String, &Held)> {
        let due: Vec<(Instant, String)> = self
            .map
            .iter()
            .filter_map(|(id, h)| match h.hold {
                Some(OnHold {
                    until,
                    then: Then::Redeliver,
                    ..
                }) if until <= now => Some((until, id.clone())),
                _ => None,
            })
            .collect();
        self.take_earliest(due, max)
    }

    /// Up to `max` held deliveries on hold whose request deadline (Unix s)
    /// is at or before `now_unix`, taken off hold: they go back to the
    /// dispatcher for their deadline answer, whatever their hold was for.
    pub(super) fn take_expired(&mut self, now_unix: i64, max: usize) -> Vec<(String, &Held)> {
        let due: Vec<(i64, String)> = self
            .map
            .iter()
            .filter_map(|(tag, h)| match (h.hold, h.info.deadline) {
                (Some(_), Some(deadline)) if deadline <= now_unix => Some((deadline, tag.clone())),
                _ => None,
            })
            .collect();
        self.take_earliest(due, max)
    }

    /// Takes the `max` earliest of `due` (deliveries on hold, keyed by
    /// when they became due) off hold, and returns them to go back to the
    /// dispatcher.
    fn take_earliest<K: Ord>(
        &mut self,
        mut due: Vec<(K, String)>,
        max: usize,
    ) -> Vec<(String, &Held)> {
        due.sort();
        due.truncate(max);
        for (_, tag) in &due {
            self.take_hold(tag);
        }
        due.into_iter()
            .filter_map(|(_, tag)| self.map.get(&tag).map(|h| (tag, h)))
            .collect()
    }

    /// Holds that end in a hand-back to the broker now: failed attempts
    /// whose backoff is over, and any hold past the budget's `max_hold`
    /// (a redelivery nobody asked for in time). Left in place: the caller
    /// removes each once handled.
    pub(super) fn due_hand_backs(&self, now: Instant, max_hold: Duration) -> Vec<String> {
        self.map
            .iter()
            .filter(|(_, h)| match h.hold {
                Some(OnHold {
                    until,
                    then: Then::HandBack,
                    ..
                }) => until <= now,
                Some(_) => now >= h.pulled_at + max_hold,
                None => false,
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Deliveries whose ack deadline is due for an extension (last set or
    /// extended `every` ago or more), on hold or with the dispatcher; marks
    /// them extended at `now`. Every lease, not only holds (issue 36): a
    /// delivery just pulled or just back from a hold could otherwise wait
    /// a whole renewal period of the dispatcher's on top of the keeper's,
    /// and on a loaded machine its deadline ran out while it was held.
    pub(super) fn take_extensions(&mut self, now: Instant, every: Duration) -> Vec<String> {
        let mut out = Vec::new();
        for (id, h) in &mut self.map {
            if now >= h.extended_at + every {
                h.extended_at = now;
                out.push(id.clone());
            }
        }
        out
    }

    /// When the keeper must next look: the earliest extension among the
    /// leases, or hand-back or budget end among the holds.
    pub(super) fn next_wake(&self, every: Duration, max_hold: Duration) -> Option<Instant> {
        self.map
            .values()
            .map(|h| {
                let mut t = h.extended_at + every;
                if let Some(hold) = h.hold {
                    t = t.min(h.pulled_at + max_hold);
                    if hold.then == Then::HandBack {
                        t = t.min(hold.until);
                    }
                }
                t
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Budget = Budget {
        max_hold: Duration::from_secs(3600),
        max_bytes: 1000,
    };

    fn facts(reason: NackReason, delay_secs: u64) -> Facts {
        let now = Instant::now();
        Facts {
            reason,
            delay: Duration::from_secs(delay_secs),
            now,
            pulled_at: now,
            deadline_in: None,
            last_delivery: false,
            size: 100,
            held_bytes: 0,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn waiting_for_the_pool_holds_the_lease_instead_of_nacking() {
        for reason in [NackReason::Congested, NackReason::NotAdmitted] {
            let f = facts(reason, 2);
            assert_eq!(
                plan(&f, &BUDGET),
                Plan::Hold {
                    until: f.now + secs(2),
                    then: Then::Redeliver
                }
            );
            // Even on its last delivery: a hold uses no attempt.
            let last = Facts {
                last_delivery: true,
                ..f
            };
            assert!(matches!(plan(&last, &BUDGET), Plan::Hold { .. }));
        }
    }

    #[test]
    fn holds_end_at_the_request_deadline_and_the_budget() {
        let f = Facts {
            deadline_in: Some(secs(1)),
            ..facts(NackReason::Congested, 30)
        };
        assert_eq!(
            plan(&f, &BUDGET),
            Plan::Hold {
                until: f.now + secs(1),
                then: Then::Redeliver
            }
        );
        let pulled_long_ago = Facts {
            pulled_at: f.now - secs(3590),
            deadline_in: None,
            ..f
        };
        assert_eq!(
            plan(&pulled_long_ago, &BUDGET),
            Plan::Hold {
                until: f.now + secs(10),
                then: Then::Redeliver
            }
        );
    }

    #[test]
    fn outside_the_budget_the_broker_gets_it_back_with_deadline_zero() {
        let base = facts(NackReason::Congested, 2);
        let too_big = Facts {
            held_bytes: 950,
            ..base
        };
        assert_eq!(plan(&too_big, &BUDGET), Plan::HandBack);
        let too_long = Facts {
            pulled_at: base.now - secs(3600),
            ..base
        };
        assert_eq!(plan(&too_long, &BUDGET), Plan::HandBack);
        // On its last delivery a hand-back would dead-letter it silently.
        let last = Facts {
            last_delivery: true,
            ..too_big
        };
        assert_eq!(plan(&last, &BUDGET), Plan::Answer);
    }

    #[test]
    fn a_failure_waits_out_its_backoff_leased_then_goes_to_the_broker() {
        let f = facts(NackReason::Failed, 5);
        assert_eq!(
            plan(&f, &BUDGET),
            Plan::Hold {
                until: f.now + secs(5),
                then: Then::HandBack
            }
        );
        assert_eq!(plan(&facts(NackReason::Failed, 0), &BUDGET), Plan::HandBack);
        let last = Facts {
            last_delivery: true,
            ..f
        };
        assert_eq!(plan(&last, &BUDGET), Plan::Answer);
    }

    #[test]
    fn shutdown_hands_back_at_once_except_a_last_delivery() {
        let f = facts(NackReason::Shutdown, 0);
        assert_eq!(plan(&f, &BUDGET), Plan::HandBack);
        let last = Facts {
            last_delivery: true,
            ..f
        };
        assert_eq!(plan(&last, &BUDGET), Plan::Answer);
    }

    #[test]
    fn the_last_delivery_is_the_one_at_the_subscriptions_limit() {
        assert!(!last_delivery(None, Some(5)));
        assert!(!last_delivery(Some(4), Some(5)));
        assert!(last_delivery(Some(5), Some(5)));
        assert!(last_delivery(Some(6), Some(5)));
        assert!(!last_delivery(Some(9), None));
        assert!(!last_delivery(Some(9), Some(0)));
    }

    #[test]
    fn time_left_is_zero_once_the_deadline_passed() {
        assert_eq!(time_left(None, 100), None);
        assert_eq!(time_left(Some(130), 100), Some(secs(30)));
        assert_eq!(time_left(Some(90), 100), Some(Duration::ZERO));
    }

    /// Records `held` as a new delivery and returns its tag.
    fn new(l: &mut Leases, held: Held) -> String {
        match l.insert(held) {
            Taken::New(tag) => tag,
            other => panic!("not a new delivery: {other:?}"),
        }
    }

    fn held(ack_id: &str, body: &str, pulled_at: Instant) -> Held {
        Held {
            ack_id: Some(ack_id.into()),
            info: Received {
                body: body.as_bytes().to_vec(),
                result_route: None,
                deadline: None,
            },
            message_id: format!("m{ack_id}"),
            joined: Vec::new(),
            published: false,
            pulled_at,
            extended_at: pulled_at,
            retry_count: 0,
            delivery_attempt: None,
            hold: None,
        }
    }

    #[test]
    fn leases_count_held_bytes_and_redeliver_earliest_first() {
        let t0 = Instant::now();
        let mut l = Leases::default();
        let a = new(&mut l, held("1", "aaaa", t0));
        let b = new(&mut l, held("2", "bb", t0));
        let c = new(&mut l, held("3", "c", t0));
        assert!(l.start_hold(&a, t0 + secs(3), Then::Redeliver));
        assert!(l.start_hold(&b, t0 + secs(1), Then::Redeliver));
        assert!(l.start_hold(&c, t0 + secs(1), Then::HandBack));
        assert!(!l.start_hold("z", t0, Then::Redeliver));
        assert_eq!(l.hold_bytes(), 7);
        assert!(l.take_redeliveries(t0, 10).is_empty());
        let due: Vec<String> = l
            .take_redeliveries(t0 + secs(5), 1)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(due, [b.as_str()]);
        assert_eq!(l.hold_bytes(), 5);
        // A failed attempt's hold never comes back to the dispatcher.
        let due: Vec<String> = l
            .take_redeliveries(t0 + secs(5), 10)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(due, [a.as_str()]);
        assert_eq!(l.due_hand_backs(t0 + secs(5), secs(3600)), [c.as_str()]);
        assert!(l.take_hold(&c));
        assert_eq!(l.hold_bytes(), 0);
        // Handed out (or already taken): the keeper leaves it alone.
        assert!(!l.take_hold(&c));
        assert!(!l.take_hold(&a));
        assert_eq!(l.remove(&c).map(|h| h.message_id), Some("m3".into()));
        assert_eq!(l.hold_bytes(), 0);
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn an_ack_id_handed_out_again_voids_the_old_lease_and_keeps_both_deliveries() {
        // The emulator numbers ack ids from 1 again after a restart.
        let t0 = Instant::now();
        let mut l = Leases::default();
        let before = new(&mut l, held("1", "old", t0));
        let other = new(&mut l, held("2", "x", t0));
        let after = new(&mut l, held("1", "new", t0));
        assert_ne!(before, after);
        assert_eq!(l.len(), 3, "the delivery held from before is still held");
        assert_eq!(l.get(&before).and_then(|h| h.ack_id.clone()), None);
        // Acking or extending the old one must not touch the new message.
        assert_eq!(l.ack_ids([&before, &after, &other]), ["1", "2"]);
        // Removing the void lease leaves the new one's ack id live.
        l.remove(&before);
        assert_eq!(l.ack_ids([&after]), ["1"]);
        let again = new(&mut l, held("1", "newer", t0));
        assert_eq!(l.ack_ids([&after, &again]), ["1"]);
        assert_eq!(
            l.get(&again).and_then(|h| h.ack_id.clone()),
            Some("1".into())
        );
    }

    #[test]
    fn expired_holds_go_back_to_the_dispatcher_whatever_they_waited_for() {
        let t0 = Instant::now();
        let mut l = Leases::default();
        let with_deadline = |ack: &str, deadline: Option<i64>| Held {
            info: Received {
                deadline,
                ..held(ack, "x", t0).info
            },
            ..held(ack, "x", t0)
        };
        let expired = new(&mut l, with_deadline("1", Some(100)));
        let failed = new(&mut l, with_deadline("2", Some(90)));
        let later = new(&mut l, with_deadline("3", Some(500)));
        let none = new(&mut l, with_deadline("4", None));
        let sending = new(&mut l, with_deadline("5", Some(50)));
        for tag in [&expired, &later, &none] {
            l.start_hold(tag, t0 + secs(60), Then::Redeliver);
        }
        l.start_hold(&failed, t0 + secs(60), Then::HandBack);
        assert_eq!(l.hold_bytes(), 4);
        let got: Vec<String> = l
            .take_expired(200, 10)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        // Earliest deadline first; one with the dispatcher is not on hold.
        assert_eq!(got, [failed.as_str(), expired.as_str()]);
        assert!(l.get(&sending).is_some_and(|h| h.hold.is_none()));
        assert_eq!(l.hold_bytes(), 2);
        assert!(l.take_expired(200, 10).is_empty());
    }

    #[test]
    fn every_lease_is_extended_every_period_and_holds_are_given_up_after_the_budget() {
        let t0 = Instant::now();
        let mut l = Leases::default();
        let a = new(&mut l, held("1", "x", t0));
        let b = new(&mut l, held("2", "y", t0));
        l.start_hold(&a, t0 + secs(100), Then::Redeliver);
        let every = secs(3);
        assert_eq!(l.next_wake(every, secs(10)), Some(t0 + every));
        assert!(l.take_extensions(t0 + secs(2), every).is_empty());
        // The dispatcher renewed b at 2 s: only the hold is due at 3 s.
        l.mark_extended([&b], t0 + secs(2));
        assert_eq!(l.take_extensions(t0 + secs(3), every), [a.as_str()]);
        assert!(l.take_extensions(t0 + secs(4), every).is_empty());
        assert_eq!(l.next_wake(every, secs(10)), Some(t0 + secs(5)));
        assert_eq!(l.take_extensions(t0 + secs(5), every), [b.as_str()]);
        assert_eq!(
            l.not_extended_within([&a, &b], t0 + secs(6), secs(2)),
            std::slice::from_ref(&a)
        );
        // A hold nobody collected within the budget goes back to the broker.
        assert!(l.due_hand_backs(t0 + secs(9), secs(10)).is_empty());
        assert_eq!(l.due_hand_backs(t0 + secs(10), secs(10)), [a]);
        assert_eq!(l.next_wake(every, secs(4)), Some(t0 + secs(4)));
    }

    #[test]
    fn a_message_delivered_again_while_held_joins_the_first_lease() {
        let t0 = Instant::now();
        let mut l = Leases::default();
        let first = new(&mut l, held("1", "x", t0));
        let again = Held {
            message_id: "m1".into(),
            ..held("7", "x", t0)
        };
        assert_eq!(l.insert(again), Taken::Joined(first.clone()));
        assert_eq!(l.len(), 1, "one delivery for the dispatcher");
        // Acks, extensions and hand-backs cover both deliveries.
        assert_eq!(l.ack_ids([&first]), ["1", "7"]);
        // The broker hands the joined ack id to another message: it is void
        // here, the first lease keeps its own.
        let other = new(&mut l, held("7", "other", t0));
        assert_eq!(l.ack_ids([&first]), ["1"]);
        assert_eq!(l.ack_ids([&other]), ["7"]);
        // Handed back without a result: a later delivery is new again.
        l.remove(&first);
        let back = Held {
            message_id: "m1".into(),
            ..held("8", "x", t0)
        };
        assert!(matches!(l.insert(back), Taken::New(_)));
    }

    #[test]
    fn a_message_delivered_again_after_its_result_is_confirmed_is_answered() {
        let t0 = Instant::now();
        let mut l = Leases::default();
        let first = new(&mut l, held("1", "x", t0));
        l.get_mut(&first).expect("held").published = true;
        l.remove(&first);
        let again = |ack: &str, body: &str| Held {
            message_id: "m1".into(),
            ..held(ack, body, t0)
        };
        assert_eq!(l.insert(again("2", "x")), Taken::Answered);
        assert_eq!(l.len(), 0);
        // The same message id on other data (the emulator after a restart)
        // is another message.
        assert!(matches!(l.insert(again("3", "y")), Taken::New(_)));
    }
}
