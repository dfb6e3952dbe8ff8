//! The tables of the `sql` transport and the `sql-quota` gate, created on
//! open.
//!
//! Upstream's tables (`async_requests`, `async_results`, the quota tables,
//! as llm-d-async's `producer-sql/sqlqueue` lays them out at 55381216 /
//! d187ffff) keep their names and columns, so a producer written for
//! upstream can enqueue into, and read results from, a database this
//! transport drains. What upstream lacks is added beside it, in columns
//! and tables upstream never reads:
//!
//! - `async_requests.lease_owner`, `lease_tag`, `lease_expires_ms`: a
//!   per-row lease (upstream leases whole partitions to dispatchers);
//!   `dispatch_epoch` is 1 while a row is leased here, so upstream's
//!   pending index (`dispatch_epoch = 0`) does not see it.
//! - `async_requests.visible_at_ms`: a retry's delay in milliseconds
//!   (upstream's `not_before` is whole seconds; it is honoured as well).
//! - `async_requests.retry_count`: failed attempts.
//! - `async_requests.tenant`: the message's tenant lane (its metadata
//!   value of the dispatcher's fairness attribute, `""` without one),
//!   written by our producers or filled by the claims of a dispatcher
//!   with an attribute (`queue/sql/lanes.rs`); `NULL` until then. Its
//!   index `sluicegate_requests_lanes` finds each tenant's head;
//!   `sluicegate_requests_unfiled` holds only the waiting rows not filed
//!   yet, so a claim's filing finds none in one probe (on the lane or
//!   pending index the planner scanned every waiting row for it: 7–8 ms
//!   a claim at 20 000 rows). Added without a version change: an older
//!   build never reads them.
//! - `sluicegate_dead_letters`: messages that used up their attempts.
//! - `sluicegate_sql_meta`: the schema version this build writes.
//! - `sluicegate_idempotency`: the submission an idempotency key records
//!   per queue (JSON) and its expiry (Unix s), written in the statement
//!   that inserts the rows (`queue/sql/client.rs`). Added without a
//!   version change: an older build never reads it.
//!
//! Both queue tables churn their whole contents (every row is inserted,
//! updated by its claim and deleted by its ack), so autovacuum runs on a
//! fixed row count without cost throttling, as upstream's newer schema
//! sets it: percentage thresholds let dead rows pile up at the head of
//! the pending index until every claim scans them.
//!
//! Every statement is idempotent (`IF NOT EXISTS`), and the whole script
//! runs as one implicit transaction under an advisory lock, so dispatchers
//! starting together create it once. It runs only when the database does
//! not record this script's identity ([`script_id`], kept in
//! `sluicegate_sql_meta`): its `CREATE INDEX` and `ALTER TABLE` lock
//! `async_requests` even when nothing is missing, so running it on every
//! open made a producer's or a second dispatcher's open wait for, and
//! deadlock with, the claims of a dispatcher draining the table.

/// Schema version of the sluicegate additions; a database written by a
/// newer, incompatible build is refused at open.
pub(crate) const SCHEMA_VERSION: u32 = 1;

/// `pg_advisory_xact_lock` key serialising schema creation ("sluiceq").
const LOCK_KEY: i64 = 0x0073_6c75_6963_6571;

/// The tenant of a stored payload for the `sql` transport's lanes, as
/// `queue/lanes.rs` reads it: `metadata[attr]` of the request (bare or in
/// an envelope's `data`) when it is a string, else `""`, also for a
/// payload that is not JSON (upstream's producer stores any text).
const LANE_FUNCTIONS: &str = r"
CREATE OR REPLACE FUNCTION sluicegate_tenant_of(p_payload TEXT, p_attr TEXT)
RETURNS TEXT LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_msg   JSONB;
    v_value JSONB;
BEGIN
    BEGIN
        v_msg := p_payload::jsonb;
    EXCEPTION WHEN others THEN
        RETURN '';
    END;
    IF jsonb_typeof(v_msg) <> 'object' THEN
        RETURN '';
    END IF;
    IF jsonb_typeof(v_msg -> 'data') = 'object' THEN
        v_msg := v_msg -> 'data';
    END IF;
    IF jsonb_typeof(v_msg -> 'metadata') <> 'object' THEN
        RETURN '';
    END IF;
    v_value := v_msg -> 'metadata' -> p_attr;
    IF v_value IS NULL OR jsonb_typeof(v_value) <> 'string' THEN
        RETURN '';
    END IF;
    RETURN v_value #>> '{}';
END $$;
";

/// `sql-quota`'s statements that must lock a key first: functions, so
/// each admission is one round trip. They count in upstream's quota
/// tables with upstream's rules (a concurrency key is full when the slots
/// of live holders reach the limit; a rate key when the admissions of the
/// trailing window do), so dispatchers of both share one count.
const QUOTA_FUNCTIONS: &str = r"
CREATE OR REPLACE FUNCTION sluicegate_quota_acquire(p_key TEXT, p_holder TEXT, p_limit INTEGER)
RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    v_now  BIGINT;
    v_used BIGINT;
BEGIN
    INSERT INTO async_quota_keys (key) VALUES (p_key) ON CONFLICT (key) DO NOTHING;
    PERFORM 1 FROM async_quota_keys WHERE key = p_key FOR UPDATE;
    v_now := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    PERFORM 1 FROM async_quota_holders WHERE holder = p_holder AND expires_ms > v_now;
    IF NOT FOUND THEN
        RETURN -1;
    END IF;
    SELECT coalesce(sum(s.used), 0) INTO v_used
    FROM async_quota_slots s JOIN async_quota_holders h ON h.holder = s.holder
    WHERE s.key = p_key AND h.expires_ms > v_now;
    IF v_used >= p_limit THEN
        RETURN 0;
    END IF;
    INSERT INTO async_quota_slots (key, holder, used) VALUES (p_key, p_holder, 1)
    ON CONFLICT (key, holder) DO UPDATE SET used = async_quota_slots.used + 1;
    RETURN 1;
END $$;
CREATE OR REPLACE FUNCTION sluicegate_quota_admit(p_key TEXT, p_limit INTEGER, p_window_ms BIGINT)
RETURNS BIGINT LANGUAGE plpgsql AS $$
DECLARE
    v_now     BIGINT;
    v_used    BIGINT;
    v_expired BIGINT;
BEGIN
    INSERT INTO async_quota_windows (key, window_ms) VALUES (p_key, p_window_ms)
    ON CONFLICT (key, window_ms) DO NOTHING;
    SELECT used INTO v_used FROM async_quota_windows
    WHERE key = p_key AND window_ms = p_window_ms FOR UPDATE;
    v_now := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    WITH gone AS (
        DELETE FROM async_quota_admits
        WHERE key = p_key AND window_ms = p_window_ms AND at_ms <= v_now - p_window_ms
        RETURNING n)
    SELECT coalesce(sum(n), 0) INTO v_expired FROM gone;
    v_used := greatest(v_used - v_expired, 0);
    IF v_used >= p_limit THEN
        UPDATE async_quota_windows SET used = v_used WHERE key = p_key AND window_ms = p_window_ms;
        RETURN 0;
    END IF;
    INSERT INTO async_quota_admits (key, window_ms, at_ms, n) VALUES (p_key, p_window_ms, v_now, 1);
    UPDATE async_quota_windows SET used = v_used + 1 WHERE key = p_key AND window_ms = p_window_ms;
    RETURN v_now;
END $$;
CREATE OR REPLACE FUNCTION sluicegate_quota_refund(p_key TEXT, p_window_ms BIGINT, p_at BIGINT)
RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    v_row tid;
BEGIN
    PERFORM 1 FROM async_quota_windows WHERE key = p_key AND window_ms = p_window_ms FOR UPDATE;
    SELECT ctid INTO v_row FROM async_quota_admits
    WHERE key = p_key AND window_ms = p_window_ms AND at_ms = p_at AND n > 0 LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    UPDATE async_quota_admits SET n = n - 1 WHERE ctid = v_row;
    UPDATE async_quota_windows SET used = greatest(used - 1, 0)
    WHERE key = p_key AND window_ms = p_window_ms;
    RETURN 1;
END $$;
";

/// Key in `sluicegate_sql_meta` of the identity of the last script run.
pub(crate) const SCRIPT_KEY: &str = "schema_script";

/// The creation script, run as one simple query (one implicit
/// transaction); its last statement records [`script_id`].
pub(crate) fn script() -> String {
    format!(
        "{}INSERT INTO sluicegate_sql_meta (key, value) VALUES ('{SCRIPT_KEY}', '{}')
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;
",
        definitions(),
        script_id()
    )
}

/// This build's script identity: FNV-1a 64 of its definitions, in hex. A
/// database that records it has every table, index and function of it.
pub(crate) fn script_id() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in definitions().as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The tables, indexes and functions, each created if missing.
fn definitions() -> String {
    format!(
        r"
SELECT pg_advisory_xact_lock({LOCK_KEY});
CREATE TABLE IF NOT EXISTS async_requests (
    id             TEXT     NOT NULL,
    request_token  TEXT     NOT NULL,
    queue          TEXT     NOT NULL,
    partition_id   INTEGER  NOT NULL,
    deadline       BIGINT   NOT NULL,
    not_before     BIGINT   NOT NULL DEFAULT 0,
    dispatch_epoch BIGINT   NOT NULL DEFAULT 0,
    cancelled      SMALLINT NOT NULL DEFAULT 0,
    payload        TEXT     NOT NULL,
    created_at     BIGINT   NOT NULL,
    PRIMARY KEY (id, request_token)
) WITH (fillfactor = 70);
CREATE INDEX IF NOT EXISTS async_requests_pending ON async_requests (queue, deadline, created_at) WHERE dispatch_epoch = 0;
CREATE INDEX IF NOT EXISTS async_requests_inflight ON async_requests (queue, partition_id) WHERE dispatch_epoch > 0;
ALTER TABLE async_requests ADD COLUMN IF NOT EXISTS lease_owner TEXT;
ALTER TABLE async_requests ADD COLUMN IF NOT EXISTS lease_tag TEXT;
ALTER TABLE async_requests ADD COLUMN IF NOT EXISTS lease_expires_ms BIGINT NOT NULL DEFAULT 0;
ALTER TABLE async_requests ADD COLUMN IF NOT EXISTS visible_at_ms BIGINT NOT NULL DEFAULT 0;
ALTER TABLE async_requests ADD COLUMN IF NOT EXISTS retry_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE async_requests SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE async_requests ADD COLUMN IF NOT EXISTS tenant TEXT;
CREATE INDEX IF NOT EXISTS sluicegate_requests_lanes ON async_requests (queue, tenant, deadline, created_at) WHERE dispatch_epoch = 0;
CREATE INDEX IF NOT EXISTS sluicegate_requests_unfiled ON async_requests (queue) WHERE dispatch_epoch = 0 AND tenant IS NULL;
CREATE UNIQUE INDEX IF NOT EXISTS sluicegate_requests_lease_tag ON async_requests (lease_tag) WHERE lease_tag IS NOT NULL;
CREATE INDEX IF NOT EXISTS sluicegate_requests_leases ON async_requests (queue, lease_expires_ms) WHERE lease_tag IS NOT NULL;
CREATE TABLE IF NOT EXISTS async_results (
    seq           BIGSERIAL PRIMARY KEY,
    route         TEXT   NOT NULL,
    id            TEXT   NOT NULL,
    request_token TEXT   NOT NULL,
    payload       TEXT   NOT NULL,
    expires_at    BIGINT NOT NULL DEFAULT 0,
    created_at    BIGINT NOT NULL
);
ALTER TABLE async_results SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);
CREATE INDEX IF NOT EXISTS async_results_route_seq ON async_results (route, seq);
CREATE INDEX IF NOT EXISTS async_results_expiry ON async_results (route, expires_at) WHERE expires_at > 0;
CREATE TABLE IF NOT EXISTS sluicegate_dead_letters (
    seq           BIGSERIAL PRIMARY KEY,
    queue         TEXT   NOT NULL,
    id            TEXT   NOT NULL,
    request_token TEXT   NOT NULL,
    payload       TEXT   NOT NULL,
    last_error    TEXT   NOT NULL,
    at_ms         BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS sluicegate_dead_letters_queue ON sluicegate_dead_letters (queue, seq);
CREATE TABLE IF NOT EXISTS sluicegate_idempotency (
    queue      TEXT   NOT NULL,
    key        TEXT   NOT NULL,
    record     TEXT   NOT NULL,
    expires_at BIGINT NOT NULL,
    PRIMARY KEY (queue, key)
);
CREATE INDEX IF NOT EXISTS sluicegate_idempotency_expiry ON sluicegate_idempotency (queue, expires_at);
CREATE TABLE IF NOT EXISTS async_quota_keys (
    key TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS async_quota_holders (
    holder     TEXT   PRIMARY KEY,
    expires_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS async_quota_slots (
    key    TEXT    NOT NULL,
    holder TEXT    NOT NULL,
    used   INTEGER NOT NULL,
    PRIMARY KEY (key, holder)
);
CREATE INDEX IF NOT EXISTS async_quota_slots_holder ON async_quota_slots (holder);
CREATE TABLE IF NOT EXISTS async_quota_windows (
    key       TEXT   NOT NULL,
    window_ms BIGINT NOT NULL,
    used      BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (key, window_ms)
);
CREATE TABLE IF NOT EXISTS async_quota_admits (
    key       TEXT    NOT NULL,
    window_ms BIGINT  NOT NULL,
    at_ms     BIGINT  NOT NULL,
    n         INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS async_quota_admits_key ON async_quota_admits (key, window_ms, at_ms);
CREATE TABLE IF NOT EXISTS sluicegate_sql_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO sluicegate_sql_meta (key, value) VALUES ('schema_version', '{SCHEMA_VERSION}')
    ON CONFLICT (key) DO NOTHING;
{QUOTA_FUNCTIONS}
{LANE_FUNCTIONS}
"
    )
}

/// FNV-1a of the id modulo upstream's 64 partitions: the `partition_id`
/// upstream's dispatcher would file the row under, so rows written here
/// stay readable by it.
pub(crate) fn partition_of(id: &str) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in id.as_bytes() {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    // Below 64: always fits.
    i32::try_from(h % 64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_match_upstreams_fnv1a() {
        // FNV-1a 32 of "a" is 0xe40c292c; 0xe40c292c % 64 = 44.
        assert_eq!(partition_of("a"), 44);
        assert_eq!(
            partition_of(""),
            i32::try_from(0x811c_9dc5_u32 % 64).unwrap_or(-1)
        );
    }
}
