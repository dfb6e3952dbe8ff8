//! Tenant lanes of the `sql` transport (issue 36): a claim takes the head
//! of every tenant's waiting rows, round robin by weight, so a small
//! tenant behind another's deep backlog is in the dispatcher's fair
//! buffer from the start, as on Redis and the embedded store.
//!
//! Producers file nothing: upstream's producer writes the table too, so
//! the dispatcher files rows itself. Each claim first fills the `tenant`
//! column of up to [`FILE_PER_CLAIM`] waiting rows that have none
//! (`sluicegate_tenant_of`, the same reading as `queue/lanes.rs`). There
//! is no lane table to keep in step: the tenants with waiting rows are
//! read from the lane index itself (a skip scan, at most 64 from a
//! random starting name), so replicas filing and claiming at once
//! share nothing but the rows, which `FOR UPDATE SKIP LOCKED` hands to
//! one of them. A claim also takes the head of the queue itself, so rows
//! not filed yet are never stranded.

use crate::queue::lanes::TenantLanes;

/// Most rows one claim files into lanes (the rest: the next claims).
pub(super) const FILE_PER_CLAIM: i64 = 10_000;

/// Files up to $3 waiting rows of queue $1 that have no lane yet under
/// their tenant by attribute $2 (rows another claim holds are skipped,
/// not waited for), and says how many it filed and whether the claim
/// needs the lanes: some waiting row is not filed, or the waiting rows
/// are in more than one lane. Otherwise (one tenant, or none waiting) the
/// lanes' heads are the queue's head, and the plain claim takes the same
/// rows with less work than the lane claim's skip scan and per-lane reads.
///
/// One statement, so a claim waits for one round trip, not two: the
/// filed 20 000-row drain ran 1.10x faster than with two statements
/// (docs/benchmarks.md, "Issue 36, continued"). The probes
/// read the snapshot from before the filing: rows filed here still count
/// as unfiled, so a claim that filed takes the lane claim, which sees
/// them filed. A row a producer files just after is seen by the next
/// claim. Three probes of the lane index.
pub(super) const FILE_AND_PROBE: &str = "WITH filed AS (
         UPDATE async_requests r SET tenant = sluicegate_tenant_of(r.payload, $2)
         FROM (SELECT id, request_token FROM async_requests
               WHERE queue = $1 AND tenant IS NULL AND dispatch_epoch = 0
               LIMIT $3 FOR UPDATE SKIP LOCKED) u
         WHERE r.id = u.id AND r.request_token = u.request_token
         RETURNING 1)
     SELECT (SELECT count(*) FROM filed),
         EXISTS (SELECT 1 FROM async_requests
                 WHERE queue = $1 AND dispatch_epoch = 0 AND tenant IS NULL)
         OR (SELECT tenant FROM async_requests
             WHERE queue = $1 AND dispatch_epoch = 0 AND tenant IS NOT NULL
             ORDER BY tenant LIMIT 1)
            IS DISTINCT FROM
            (SELECT tenant FROM async_requests
             WHERE queue = $1 AND dispatch_epoch = 0 AND tenant IS NOT NULL
             ORDER BY tenant DESC LIMIT 1)";

/// The visible waiting rows of queue $1, as the plain claim reads them.
macro_rules! visible {
    () => {
        concat!(
            "queue = $1 AND dispatch_epoch = 0 AND visible_at_ms <= ",
            now_ms!(),
            " AND not_before <= ",
            now_ms!(),
            " / 1000"
        )
    };
}

/// Leases up to $2 rows of queue $1 for $4 ms, owner $3: the heads of up
/// to 64 tenant lanes (names from $5 upward, then wrapping round) and of
/// the queue, round robin, lane `t` taking its weight ($6 names, $7
/// weights; 1 when not named) in rows per round, the queue's head one.
pub(super) const CLAIM: &str = concat!(
    "WITH RECURSIVE upward(tenant, n) AS (
         SELECT (SELECT tenant FROM async_requests
                 WHERE queue = $1 AND dispatch_epoch = 0 AND tenant >= $5
                 ORDER BY tenant LIMIT 1), 1
         UNION ALL
         SELECT (SELECT a.tenant FROM async_requests a
                 WHERE a.queue = $1 AND a.dispatch_epoch = 0 AND a.tenant > u.tenant
                 ORDER BY a.tenant LIMIT 1), u.n + 1
         FROM upward u WHERE u.tenant IS NOT NULL AND u.n < 64),
     wrapped(tenant, n) AS (
         SELECT (SELECT tenant FROM async_requests
                 WHERE queue = $1 AND dispatch_epoch = 0 AND tenant IS NOT NULL
                 ORDER BY tenant LIMIT 1), 1
         UNION ALL
         SELECT (SELECT a.tenant FROM async_requests a
                 WHERE a.queue = $1 AND a.dispatch_epoch = 0 AND a.tenant > w.tenant
                 ORDER BY a.tenant LIMIT 1), w.n + 1
         FROM wrapped w WHERE w.tenant IS NOT NULL AND w.tenant < $5 AND w.n < 64),
     tenants AS (
         SELECT tenant FROM (
             SELECT tenant FROM upward WHERE tenant IS NOT NULL
             UNION SELECT tenant FROM wrapped WHERE tenant IS NOT NULL AND tenant < $5) t
         LIMIT 64),
     weights AS (SELECT * FROM unnest($6::text[], $7::int[]) AS w(tenant, weight)),
     heads AS (
         SELECT h.id, h.request_token, h.deadline, h.created_at,
             (h.rank - 1) / COALESCE(w.weight, 1) AS round
         FROM tenants t LEFT JOIN weights w ON w.tenant = t.tenant
         CROSS JOIN LATERAL (
             SELECT x.*, row_number() OVER (ORDER BY x.deadline, x.created_at) AS rank
             FROM (SELECT id, request_token, deadline, created_at FROM async_requests
                   WHERE tenant = t.tenant AND ",
    visible!(),
    "
                   ORDER BY deadline, created_at
                   LIMIT $2::bigint * COALESCE(w.weight, 1)) x) h
         UNION ALL
         SELECT y.id, y.request_token, y.deadline, y.created_at,
             row_number() OVER (ORDER BY y.deadline, y.created_at) - 1
         FROM (SELECT id, request_token, deadline, created_at FROM async_requests
               WHERE ",
    visible!(),
    "
               ORDER BY deadline, created_at LIMIT $2) y),
     chosen AS (
         SELECT id, request_token, min(round) AS round, min(deadline) AS deadline,
             min(created_at) AS created_at
         FROM heads GROUP BY id, request_token
         ORDER BY round, deadline, created_at LIMIT $2),
     picked AS MATERIALIZED (
         SELECT a.id, a.request_token FROM async_requests a
         JOIN chosen c ON a.id = c.id AND a.request_token = c.request_token
         WHERE a.dispatch_epoch = 0
         FOR UPDATE OF a SKIP LOCKED)",
    lease_picked!()
);

/// The weights of `lanes` as the claim's two arrays ($6 names, $7
/// weights).
pub(super) fn weight_arrays(lanes: &TenantLanes) -> (Vec<String>, Vec<i32>) {
    lanes
        .weights
        .iter()
        .map(|(tenant, weight)| (tenant.clone(), i32::try_from(*weight).unwrap_or(i32::MAX)))
        .unzip()
}

/// A random lane name to start a claim's visit from, so that with more
/// than 64 tenants every one is visited in turn.
pub(super) fn random_start() -> String {
    format!("{:08x}", rand::random::<u32>())
}
