//! Tenant lanes of the embedded store (issue 22): a claim takes the head
//! of every tenant's messages, round robin by weight, so a small tenant
//! behind another's deep backlog is in the dispatcher's fair buffer from
//! the start, as the Redis transport's lanes do.
//!
//! The store is ours alone, so no producer needs to know the attribute:
//! each message's `tenant` column is filled by the first claim that sees
//! it (its value of the fairness attribute, `""` without one), and the
//! `lanes` table lists the tenants with messages. A claim also takes the
//! head of the queue itself, so rows not filed yet (more than one claim
//! files) are never stranded.

use std::collections::{BTreeMap, HashSet};

use rusqlite::{Transaction, params};
use serde::Deserialize;

/// The dispatcher's fairness settings, for the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantLanes {
    /// `[gateway] fairness_attribute`: the metadata key naming the tenant.
    pub attribute: String,
    /// `dispatch.tenant_weights`: members taken per round (1 when not named).
    pub weights: BTreeMap<String, u32>,
}

/// Most rows one claim files into lanes (the rest: the next claims).
const FILE_PER_CLAIM: i64 = 10_000;
/// Most lanes one claim visits (sampled at random when there are more).
const MAX_LANES: i64 = 64;

/// A message row as the claim reads it: seq, body, retry count.
pub(super) type Row = (i64, Vec<u8>, u32);

/// Rows a claim may take: never leased, or leased and expired, and due.
pub(super) const CLAIMABLE: &str = "((lease_tag IS NULL AND visible_at_ms <= ?2)
    OR (lease_tag IS NOT NULL AND lease_expires_ms <= ?2))";

/// The tenant of a message: `metadata[attribute]` of the request (bare or
/// in an envelope's `data`); `""` without one or when it cannot be read.
pub(super) fn tenant_of(body: &[u8], attribute: &str) -> String {
    #[derive(Deserialize)]
    struct Request {
        #[serde(default)]
        metadata: BTreeMap<String, serde_json::Value>,
    }
    #[derive(Deserialize)]
    struct Message {
        data: Option<Request>,
        #[serde(default)]
        metadata: BTreeMap<String, serde_json::Value>,
    }
    let Ok(message) = serde_json::from_slice::<Message>(body) else {
        return String::new();
    };
    let metadata = match message.data {
        Some(data) => data.metadata,
        None => message.metadata,
    };
    match metadata.get(attribute) {
        Some(serde_json::Value::String(tenant)) => tenant.clone(),
        _ => String::new(),
    }
}

/// Round robin over `sources` (each with its weight: members taken per
/// round), skipping keys already taken, up to `max`.
pub(super) fn interleave<T>(
    sources: Vec<(u32, Vec<T>)>,
    max: usize,
    key: impl Fn(&T) -> i64,
) -> Vec<T> {
    let mut sources: Vec<(u32, std::vec::IntoIter<T>)> = sources
        .into_iter()
        .map(|(weight, items)| (weight, items.into_iter()))
        .collect();
    let mut taken = HashSet::new();
    let mut out = Vec::new();
    loop {
        let mut any = false;
        for (weight, items) in &mut sources {
            for _ in 0..*weight {
                if out.len() >= max {
                    return out;
                }
                let Some(item) = items.next() else { break };
                any = true;
                if taken.insert(key(&item)) {
                    out.push(item);
                }
            }
        }
        if !any {
            return out;
        }
    }
}

/// Files rows not yet in a lane (tenant NULL) into their tenant's lane.
fn file_new_rows(tx: &Transaction<'_>, queue: &str, attribute: &str) -> rusqlite::Result<()> {
    let rows: Vec<(i64, Vec<u8>)> = {
        let mut s = tx.prepare_cached(
            "SELECT seq, body FROM messages WHERE queue = ?1 AND tenant IS NULL LIMIT ?2",
        )?;
        s.query_map(params![queue, FILE_PER_CLAIM], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?
        .collect::<rusqlite::Result<_>>()?
    };
    let mut set = tx.prepare_cached("UPDATE messages SET tenant = ?1 WHERE seq = ?2")?;
    let mut lane =
        tx.prepare_cached("INSERT OR IGNORE INTO lanes (queue, tenant) VALUES (?1, ?2)")?;
    for (seq, body) in rows {
        let tenant = tenant_of(&body, attribute);
        set.execute(params![tenant, seq])?;
        lane.execute(params![queue, tenant])?;
    }
    Ok(())
}

/// Up to `max` claimable rows: the heads of the tenant lanes and of the
/// queue, round robin by weight (see the module docs). Files new rows
/// first and drops lanes that hold no message any more.
pub(super) fn heads(
    tx: &Transaction<'_>,
    queue: &str,
    lanes: &TenantLanes,
    now: i64,
    max: usize,
) -> rusqlite::Result<Vec<Row>> {
    file_new_rows(tx, queue, &lanes.attribute)?;
    let limit = i64::try_from(max).unwrap_or(i64::MAX);
    let tenants: Vec<String> = {
        let mut s = tx.prepare_cached(
            "SELECT tenant FROM lanes WHERE queue = ?1 ORDER BY random() LIMIT ?2",
        )?;
        s.query_map(params![queue, MAX_LANES], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?
    };
    let read = |sql: &str, tenant: Option<&str>, n: i64| -> rusqlite::Result<Vec<Row>> {
        let mut s = tx.prepare_cached(sql)?;
        let map = |r: &rusqlite::Row<'_>| Ok((r.get(0)?, r.get(1)?, r.get(2)?));
        match tenant {
            Some(t) => s.query_map(params![queue, now, n, t], map)?.collect(),
            None => s.query_map(params![queue, now, n], map)?.collect(),
        }
    };
    let lane_sql = format!(
        "SELECT seq, body, retry_count FROM messages
         WHERE queue = ?1 AND tenant = ?4 AND {CLAIMABLE}
         ORDER BY deadline, seq LIMIT ?3"
    );
    let head_sql = format!(
        "SELECT seq, body, retry_count FROM messages
         WHERE queue = ?1 AND {CLAIMABLE}
         ORDER BY deadline, seq LIMIT ?3"
    );
    let mut sources = Vec::with_capacity(tenants.len() + 1);
    for tenant in tenants {
        let weight = lanes.weights.get(&tenant).copied().unwrap_or(1);
        let rows = read(
            &lane_sql,
            Some(&tenant),
            limit.saturating_mul(i64::from(weight)),
        )?;
        if rows.is_empty() {
            // Nothing claimable: a lane whose messages are all gone leaves.
            tx.execute(
                "DELETE FROM lanes WHERE queue = ?1 AND tenant = ?2
                 AND NOT EXISTS (SELECT 1 FROM messages WHERE queue = ?1 AND tenant = ?2)",
                params![queue, tenant],
            )?;
            continue;
        }
        sources.push((weight, rows));
    }
    sources.push((1, read(&head_sql, None, limit)?));
    Ok(interleave(sources, max, |row| row.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_is_the_attribute_of_a_bare_request_or_an_envelope() {
        let bare = br#"{"id":"a","metadata":{"userid":"alice"}}"#;
        let envelope = br#"{"data":{"id":"a","metadata":{"userid":"bob"}},"internal":{}}"#;
        assert_eq!(tenant_of(bare, "userid"), "alice");
        assert_eq!(tenant_of(envelope, "userid"), "bob");
        assert_eq!(tenant_of(bare, "team"), "");
        assert_eq!(tenant_of(br#"{"metadata":{"userid":7}}"#, "userid"), "");
        assert_eq!(tenant_of(b"not json", "userid"), "");
    }

    #[test]
    fn interleave_takes_each_weight_per_round_and_skips_repeats() {
        let got = interleave(
            vec![
                (3, vec![1, 2, 3, 4, 5, 6]),
                (1, vec![10, 11]),
                (1, vec![1, 2, 10]),
            ],
            8,
            |x| *x,
        );
        assert_eq!(got, vec![1, 2, 3, 10, 4, 5, 6, 11]);
        let all = interleave(vec![(1, vec![1, 2]), (2, vec![3])], 10, |x| *x);
        assert_eq!(all, vec![1, 3, 2]);
        assert!(interleave(vec![(1, vec![1])], 0, |x| *x).is_empty());
    }
}
