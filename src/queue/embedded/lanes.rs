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
//! files) are never stranded. The tenant of a message and the round robin
//! are shared with the in-memory queue (`queue/lanes.rs`).

use rusqlite::{Transaction, params};

pub use crate::queue::lanes::TenantLanes;
use crate::queue::lanes::interleave;
pub(super) use crate::queue::lanes::tenant_of;

/// Most rows one claim files into lanes (the rest: the next claims).
const FILE_PER_CLAIM: i64 = 10_000;
/// Most lanes one claim visits (sampled at random when there are more).
const MAX_LANES: i64 = 64;

/// A message row as the claim reads it: seq, body, retry count.
pub(super) type Row = (i64, Vec<u8>, u32);

/// Rows a claim may take: never leased, or leased and expired, and due.
pub(super) const CLAIMABLE: &str = "((lease_tag IS NULL AND visible_at_ms <= ?2)
    OR (lease_tag IS NOT NULL AND lease_expires_ms <= ?2))";

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
        let weight = lanes.weight(&tenant);
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
