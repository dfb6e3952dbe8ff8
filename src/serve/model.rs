//! The stored records (files, batches) and the OpenAI object shapes they
//! are served as. Records carry their tenant; the API shapes never do.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::order::Order;
use crate::clock::unix_secs;

pub use crate::batch_status::BatchStatus;

/// Why a running batch is being stopped before all its requests ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// The tenant cancelled it.
    Cancel,
    /// Its completion window ended.
    Expire,
}

/// A stored file: an upload (`purpose = batch`) or a batch's output or
/// error file (`purpose = batch_output`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileRecord {
    /// `file-…`.
    pub id: String,
    /// The owning tenant.
    pub tenant: String,
    /// Size of the body.
    pub bytes: u64,
    /// Unix seconds.
    pub created_at: i64,
    /// The uploaded name.
    pub filename: String,
    /// `batch` or `batch_output`.
    pub purpose: String,
    /// Unix seconds after which the retention sweep deletes it and it
    /// answers 404; `None` keeps it until deleted (also every record
    /// written before retention existed).
    #[serde(default)]
    pub expires_at: Option<i64>,
}

impl FileRecord {
    /// The OpenAI File object.
    pub fn api(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": null,
            "expires_at": self.expires_at,
        })
    }

    /// Whether its retention ended by `now` (Unix seconds).
    pub fn expired(&self, now: i64) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }
}

/// One entry of a batch's `errors.data`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LineError {
    /// Machine-readable code, e.g. `invalid_json_line`.
    pub code: String,
    /// What is wrong.
    pub message: String,
    /// The offending parameter, when one is known.
    pub param: Option<String>,
    /// 1-based input line, when the error is about one line.
    pub line: Option<u64>,
}

/// A stored batch. Request counts are not in the record: they are read
/// from the store's results, so they move while the batch runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchRecord {
    /// `batch_…`.
    pub id: String,
    /// The owning tenant.
    pub tenant: String,
    /// The endpoint every line must name, e.g. `/v1/chat/completions`.
    pub endpoint: String,
    /// The uploaded input file.
    pub input_file_id: String,
    /// As given, e.g. `24h`.
    pub completion_window: String,
    /// Lifecycle state.
    pub status: BatchStatus,
    /// Why it is stopping early, once it is.
    pub stop: Option<Stop>,
    /// Requests in the batch (known once validated).
    pub total: u64,
    /// Whether every request that will be sent has been enqueued (only
    /// then can the counts reach `total`).
    #[serde(default)]
    pub enqueued: bool,
    /// Input validation errors, first ones only (see `errors_omitted`).
    pub errors: Vec<LineError>,
    /// Further errors not listed.
    pub errors_omitted: u64,
    /// Written at the end, when it has lines.
    pub output_file_id: Option<String>,
    /// Written at the end, when it has lines.
    pub error_file_id: Option<String>,
    /// The tenant's own key/value pairs.
    pub metadata: BTreeMap<String, String>,
    /// `output_expires_after.seconds`: the output and error files expire
    /// this long after they are written; `None` = `serve.file_retention`.
    #[serde(default)]
    pub output_expires_after: Option<i64>,
    /// Unix seconds of each step.
    pub created_at: i64,
    /// Each request's deadline, and the batch's.
    pub expires_at: i64,
    /// When validation ended and dispatch began.
    pub in_progress_at: Option<i64>,
    /// When output writing began.
    pub finalizing_at: Option<i64>,
    /// When it completed.
    pub completed_at: Option<i64>,
    /// When validation refused it.
    pub failed_at: Option<i64>,
    /// When it ended expired.
    pub expired_at: Option<i64>,
    /// When the cancel was asked.
    pub cancelling_at: Option<i64>,
    /// When it ended cancelled.
    pub cancelled_at: Option<i64>,
    /// When a server last took a step on it (validation or finalizing),
    /// so another replica can take over a step whose server died.
    pub touched_at: i64,
    /// The requests and estimated tokens reserved against its tenant's
    /// `serve.tenant_limits` at creation (released as results come,
    /// `super::quota`); `None` when the tenant had no limit. Left out of
    /// the stored JSON when `None`, so records written before limits
    /// existed read back byte for byte (the compare-and-set compares it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<super::quota::Estimate>,
    /// `serve.pass_headers` the creation carried, sent with each of its
    /// requests; left out of the stored JSON when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The order its lines are enqueued in (`serve.order` or its
    /// metadata's `sluicegate_order`), fixed at creation so an intake
    /// resumed by a server with another setting keeps it; left out of the
    /// stored JSON when `arrival`.
    #[serde(default, skip_serializing_if = "Order::is_arrival")]
    pub order: Order,
}

/// What a new batch is made of (`POST /v1/batches`).
#[derive(Debug, Clone)]
pub struct NewBatch {
    /// The owning tenant.
    pub tenant: String,
    /// The endpoint every line must name.
    pub endpoint: String,
    /// The uploaded input file.
    pub input_file_id: String,
    /// As given, e.g. `24h`.
    pub completion_window: String,
    /// The window in seconds.
    pub window_secs: i64,
    /// The tenant's own key/value pairs.
    pub metadata: BTreeMap<String, String>,
    /// `output_expires_after.seconds`, when given.
    pub output_expires_after: Option<i64>,
}

impl BatchRecord {
    /// A new batch in `validating`, created now, with a fresh id.
    pub fn new(new: NewBatch) -> Self {
        let created_at = unix_secs();
        Self {
            id: new_id("batch_"),
            tenant: new.tenant,
            endpoint: new.endpoint,
            input_file_id: new.input_file_id,
            completion_window: new.completion_window,
            status: BatchStatus::Validating,
            stop: None,
            total: 0,
            enqueued: false,
            errors: Vec::new(),
            errors_omitted: 0,
            output_file_id: None,
            error_file_id: None,
            metadata: new.metadata,
            output_expires_after: new.output_expires_after,
            created_at,
            expires_at: created_at.saturating_add(new.window_secs),
            in_progress_at: None,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            touched_at: created_at,
            held: None,
            headers: BTreeMap::new(),
            order: Order::Arrival,
        }
    }

    /// The OpenAI Batch object, with `completed` / `failed` counts as
    /// read from the results so far.
    pub fn api(&self, completed: u64, failed: u64) -> Value {
        let errors = (!self.errors.is_empty()).then(|| {
            json!({
                "object": "list",
                "data": self.errors.iter().map(|e| json!({
                    "code": e.code, "message": e.message, "param": e.param, "line": e.line,
                })).collect::<Vec<_>>(),
            })
        });
        json!({
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.as_str(),
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": completed, "failed": failed},
            "metadata": self.metadata,
        })
    }

    /// The queue message id of this batch's request `custom_id`: batch ids
    /// hold no `:`, so [`split_message_id`] finds both halves again.
    pub fn message_id(&self, custom_id: &str) -> String {
        format!("{}:{custom_id}", self.id)
    }
}

/// `(batch id, custom_id)` of a queue message id made by
/// [`BatchRecord::message_id`]; `None` for other messages.
pub fn split_message_id(id: &str) -> Option<(&str, &str)> {
    id.strip_prefix("batch_")?;
    id.split_once(':')
}

/// A new random id with `prefix` (`file-`, `batch_`): 24 hex digits.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

/// The API list object: `data` plus cursor fields.
pub fn list(data: Vec<Value>, has_more: bool) -> Value {
    let id = |v: Option<&Value>| v.and_then(|v| v.get("id")).cloned();
    json!({
        "object": "list",
        "first_id": id(data.first()),
        "last_id": id(data.last()),
        "has_more": has_more,
        "data": data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_split_back_into_batch_and_custom_id() {
        assert_eq!(
            split_message_id("batch_00ab:req:1"),
            Some(("batch_00ab", "req:1"))
        );
        assert_eq!(split_message_id("req-1"), None);
        assert_eq!(split_message_id("batchless:x"), None);
    }

    #[test]
    fn statuses_spell_as_openai_does() {
        for s in BatchStatus::ALL {
            let json = serde_json::to_value(s).expect("serialises");
            assert_eq!(json, Value::String(s.as_str().to_owned()));
        }
    }
}
