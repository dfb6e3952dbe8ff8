//! The states of an OpenAI batch, as the API spells them: the Batch API
//! server (`serve`) moves batches through them, and the telemetry creates
//! one `sluicegate_batches` series per state for every queue. On the
//! ground floor so both can name them.

use serde::{Deserialize, Serialize};

/// A batch's lifecycle state, spelled as the OpenAI API spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    /// The input file is being checked and its requests enqueued.
    Validating,
    /// The input file was refused (`errors` says why, line by line).
    Failed,
    /// Requests are going through the queue and the gate.
    InProgress,
    /// Every request has a result; the output files are being written.
    Finalizing,
    /// Done; output and error files are ready.
    Completed,
    /// The completion window ended first; finished results are kept.
    Expired,
    /// A cancel was asked; requests in flight are finishing.
    Cancelling,
    /// Cancelled; finished results are kept.
    Cancelled,
}

impl BatchStatus {
    /// Every status, for the `sluicegate_batches` series (created at
    /// zero for every queue).
    pub const ALL: [Self; 8] = [
        Self::Validating,
        Self::Failed,
        Self::InProgress,
        Self::Finalizing,
        Self::Completed,
        Self::Expired,
        Self::Cancelling,
        Self::Cancelled,
    ];

    /// The API spelling (also the metric label).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Validating => "validating",
            Self::Failed => "failed",
            Self::InProgress => "in_progress",
            Self::Finalizing => "finalizing",
            Self::Completed => "completed",
            Self::Expired => "expired",
            Self::Cancelling => "cancelling",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether nothing more happens to the batch.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Failed | Self::Completed | Self::Expired | Self::Cancelled
        )
    }
}
