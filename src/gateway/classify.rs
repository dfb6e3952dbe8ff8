//! What one attempt's answer means: status classes, attempt outcomes and
//! failures, and `Retry-After` parsing. Pure; the client fills these in.

use std::time::{Duration, SystemTime};

/// Longest `Retry-After` honoured; a larger value is clamped to this so a
/// misbehaving server cannot park work for days.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// How a gateway status code is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusClass {
    /// 2xx: the answer is the result.
    Success,
    /// The pool is saturated (429, 503): budget to zero, requeue with delay.
    Congested,
    /// A server-side failure worth another attempt (5xx except 501, 503, 505).
    Retryable,
    /// The answer is the result and another attempt would get the same one:
    /// 1xx/3xx (redirects are not followed), 4xx except 429, 501, 505, and
    /// anything outside 100–599.
    Final,
}

/// Classifies an HTTP status code. 501 (not implemented) and 505 (version
/// not supported) are final because the same request gets the same answer.
pub const fn classify_status(status: u16) -> StatusClass {
    match status {
        200..=299 => StatusClass::Success,
        429 | 503 => StatusClass::Congested,
        501 | 505 => StatusClass::Final,
        500..=599 => StatusClass::Retryable,
        _ => StatusClass::Final,
    }
}

/// What one attempt produced, as the dispatch loop needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// 2xx with its body.
    Success {
        /// HTTP status.
        status: u16,
        /// Body, UTF-8 decoded lossily.
        body: String,
    },
    /// A final HTTP answer (see [`StatusClass::Final`]): status and body
    /// become the result. The body is truncated at the size limit.
    Final {
        /// HTTP status.
        status: u16,
        /// Body, UTF-8 decoded lossily, at most the size limit.
        body: String,
    },
    /// 429 or 503: the pool is saturated. Not a failure: force the budget
    /// to zero until a newer observation and requeue with a delay.
    Congested {
        /// HTTP status (429 or 503).
        status: u16,
        /// Body, UTF-8 decoded lossily, at most the size limit.
        body: String,
        /// The server's `Retry-After`, clamped to [`MAX_RETRY_AFTER`].
        retry_after: Option<Duration>,
        /// `x-llm-d-request-dropped-reason`, when the endpoint picker set it.
        dropped_reason: Option<String>,
    },
    /// A failure worth another attempt while the deadline and the attempt
    /// count allow (see [`crate::gateway::RetryPolicy::decide`]).
    Retryable {
        /// What went wrong; [`AttemptFailure::Http`] keeps the last answer.
        failure: AttemptFailure,
        /// The server's `Retry-After` on a 5xx, clamped.
        retry_after: Option<Duration>,
    },
    /// A failure another attempt would repeat, with no usable HTTP answer:
    /// becomes an `INFERENCE_ERROR` result. Currently
    /// [`AttemptFailure::BodyTooLarge`] on a 2xx and
    /// [`AttemptFailure::Request`].
    Failed {
        /// What went wrong.
        failure: AttemptFailure,
    },
    /// The deadline passed before the attempt (nothing was sent) or during
    /// it (the attempt was abandoned).
    DeadlineExceeded,
}

impl AttemptOutcome {
    /// A bounded label for metrics: `success`, `final`, `congested`,
    /// `retryable`, `failed` or `deadline_exceeded`.
    pub const fn label(&self) -> &'static str {
        match self {
            Self::Success { .. } => "success",
            Self::Final { .. } => "final",
            Self::Congested { .. } => "congested",
            Self::Retryable { .. } => "retryable",
            Self::Failed { .. } => "failed",
            Self::DeadlineExceeded => "deadline_exceeded",
        }
    }

    /// The HTTP status the gateway answered with, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Success { status, .. }
            | Self::Final { status, .. }
            | Self::Congested { status, .. } => Some(*status),
            Self::Retryable { failure, .. } => failure.http_answer().map(|(status, _)| status),
            Self::Failed { .. } | Self::DeadlineExceeded => None,
        }
    }

    /// Whether the dispatch loop should requeue the message for another
    /// attempt (congestion or a retryable failure).
    pub const fn is_retryable(&self) -> bool {
        matches!(self, Self::Congested { .. } | Self::Retryable { .. })
    }

    /// Whether this outcome says the pool cannot take work now: a 429/503,
    /// or a failure below HTTP ([`AttemptFailure::is_congestion_signal`]).
    /// Each holds every queue on the gateway.
    pub const fn is_congestion_signal(&self) -> bool {
        match self {
            Self::Congested { .. } => true,
            Self::Retryable { failure, .. } => failure.is_congestion_signal(),
            _ => false,
        }
    }

    /// The delay the server asked for, if any.
    pub const fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Congested { retry_after, .. } | Self::Retryable { retry_after, .. } => {
                *retry_after
            }
            _ => None,
        }
    }
}

/// Why an attempt failed. Transport details are rendered to text once, at
/// classification, so outcomes can be cloned into results and requeue
/// decisions; the text never contains the request URL or headers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttemptFailure {
    /// A 5xx answer; kept so the last HTTP answer can become the result
    /// when retries run out.
    #[error("gateway answered {status}")]
    Http {
        /// HTTP status.
        status: u16,
        /// Body, UTF-8 decoded lossily, at most the size limit.
        body: String,
    },
    /// No connection could be made (refused, DNS, TLS handshake, connect
    /// timeout).
    #[error("could not connect to the gateway: {0}")]
    Connect(String),
    /// The attempt timeout passed before the answer was complete.
    #[error("gateway attempt timed out")]
    Timeout,
    /// The exchange broke after connecting: reset, closed before a complete
    /// answer, or a protocol error.
    #[error("gateway connection failed: {0}")]
    Reset(String),
    /// The status and headers arrived but reading the body failed.
    #[error("reading the gateway's answer failed: {0}")]
    Body(String),
    /// A 2xx body was larger than the limit: final, since another attempt
    /// would produce an equally large answer.
    #[error("gateway answer is larger than {limit} bytes")]
    BodyTooLarge {
        /// The configured limit in bytes.
        limit: usize,
    },
    /// The request could not be built or sent for a local reason: final.
    #[error("gateway request could not be built: {0}")]
    Request(String),
}

impl AttemptFailure {
    /// A bounded label for metrics: `http_5xx`, `connect`, `timeout`,
    /// `reset`, `body`, `body_too_large` or `request`.
    pub const fn label(&self) -> &'static str {
        match self {
            Self::Http { .. } => "http_5xx",
            Self::Connect(_) => "connect",
            Self::Timeout => "timeout",
            Self::Reset(_) => "reset",
            Self::Body(_) => "body",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::Request(_) => "request",
        }
    }

    /// Whether another attempt may succeed.
    pub const fn is_retryable(&self) -> bool {
        match self {
            Self::Http { .. }
            | Self::Connect(_)
            | Self::Timeout
            | Self::Reset(_)
            | Self::Body(_) => true,
            Self::BodyTooLarge { .. } | Self::Request(_) => false,
        }
    }

    /// Whether this failure says the pool cannot take work now, as a
    /// 429/503 does (issue 22): the connection was refused, reset or broke
    /// mid-answer, or the attempt timed out. A gateway failing this way
    /// fails every request alike, so per-request backoff alone let the
    /// attempt rate grow with the backlog (228 attempts/s with 2 000
    /// queued); as congestion signals they hold every queue on the gateway
    /// and only one probe tests it. A 5xx is the pool's own answer to one
    /// request and keeps per-request backoff; a local failure
    /// ([`Self::Request`], [`Self::BodyTooLarge`]) says nothing of the pool.
    pub const fn is_congestion_signal(&self) -> bool {
        match self {
            Self::Connect(_) | Self::Timeout | Self::Reset(_) | Self::Body(_) => true,
            Self::Http { .. } | Self::BodyTooLarge { .. } | Self::Request(_) => false,
        }
    }

    /// The HTTP answer this failure carries (status, body), if any: when
    /// retries run out, the last such answer is the result.
    pub fn http_answer(&self) -> Option<(u16, &str)> {
        match self {
            Self::Http { status, body } => Some((*status, body.as_str())),
            _ => None,
        }
    }
}

/// Parses a `Retry-After` value (delay seconds or HTTP date) against the
/// wall clock now. See [`parse_retry_after_at`].
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    parse_retry_after_at(value, SystemTime::now())
}

/// Parses a `Retry-After` value against `now`: a non-negative integer of
/// seconds or an HTTP date. Dates in the past mean zero; values beyond
/// [`MAX_RETRY_AFTER`] (including integers too large to parse) are clamped
/// to it; anything else is `None`.
pub fn parse_retry_after_at(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: only overflow can fail, and an overflowing delay is
        // simply "very long".
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .map_or(Duration::ZERO, |ahead| ahead.min(MAX_RETRY_AFTER)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn classifies_statuses() {
        assert_eq!(classify_status(200), StatusClass::Success);
        assert_eq!(classify_status(204), StatusClass::Success);
        assert_eq!(classify_status(429), StatusClass::Congested);
        assert_eq!(classify_status(503), StatusClass::Congested);
        for s in [500, 502, 504, 507, 599] {
            assert_eq!(classify_status(s), StatusClass::Retryable, "{s}");
        }
        for s in [
            100, 301, 302, 400, 401, 404, 408, 413, 422, 501, 505, 600, 999,
        ] {
            assert_eq!(classify_status(s), StatusClass::Final, "{s}");
        }
    }

    #[test]
    fn retry_after_seconds() {
        let now = SystemTime::now();
        assert_eq!(parse_retry_after_at("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after_at(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after_at("86400", now), Some(MAX_RETRY_AFTER));
        assert_eq!(
            parse_retry_after_at("99999999999999999999999999", now),
            Some(MAX_RETRY_AFTER)
        );
    }

    #[test]
    fn retry_after_http_date() {
        let now = UNIX_EPOCH + Duration::from_secs(1_445_412_480); // Wed, 21 Oct 2015 07:28:00 GMT
        assert_eq!(
            parse_retry_after_at("Wed, 21 Oct 2015 07:28:30 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after_at("Wed, 21 Oct 2015 07:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after_at("Thu, 22 Oct 2015 07:28:00 GMT", now),
            Some(MAX_RETRY_AFTER)
        );
    }

    #[test]
    fn retry_after_garbage_is_ignored() {
        let now = SystemTime::now();
        for v in [
            "",
            "  ",
            "-5",
            "1.5",
            "soon",
            "7s",
            "0x10",
            "Wed, 99 Oct 2015",
        ] {
            assert_eq!(parse_retry_after_at(v, now), None, "{v:?}");
        }
    }

    #[test]
    fn failure_labels_and_classes() {
        let http = AttemptFailure::Http {
            status: 502,
            body: "bad".into(),
        };
        assert_eq!(http.label(), "http_5xx");
        assert_eq!(http.http_answer(), Some((502, "bad")));
        assert!(http.is_retryable());
        assert!(!AttemptFailure::BodyTooLarge { limit: 1 }.is_retryable());
        assert_eq!(AttemptFailure::Timeout.label(), "timeout");
        assert!(!http.is_congestion_signal());
        for signal in [
            AttemptFailure::Connect("refused".into()),
            AttemptFailure::Timeout,
            AttemptFailure::Reset("reset by peer".into()),
            AttemptFailure::Body("closed".into()),
        ] {
            assert!(signal.is_congestion_signal(), "{signal:?}");
            assert!(signal.is_retryable(), "{signal:?}");
        }
        assert!(!AttemptFailure::Request("bad".into()).is_congestion_signal());
        assert!(!AttemptFailure::BodyTooLarge { limit: 1 }.is_congestion_signal());
        let outcome = AttemptOutcome::Retryable {
            failure: http,
            retry_after: Some(Duration::from_secs(2)),
        };
        assert_eq!(outcome.status(), Some(502));
        assert_eq!(outcome.retry_after(), Some(Duration::from_secs(2)));
        assert!(outcome.is_retryable());
        assert!(!AttemptOutcome::DeadlineExceeded.is_retryable());
        assert!(
            !outcome.is_congestion_signal(),
            "a 5xx keeps its own backoff"
        );
        let reset = AttemptOutcome::Retryable {
            failure: AttemptFailure::Reset("reset".into()),
            retry_after: None,
        };
        assert!(reset.is_congestion_signal());
        let congested = AttemptOutcome::Congested {
            status: 429,
            body: String::new(),
            retry_after: None,
            dropped_reason: None,
        };
        assert!(congested.is_congestion_signal());
        assert!(!AttemptOutcome::DeadlineExceeded.is_congestion_signal());
    }

    proptest! {
        #[test]
        fn retry_after_never_panics_and_is_clamped(value in ".{0,64}", secs in any::<u64>()) {
            let now = UNIX_EPOCH + Duration::from_secs(secs % 4_000_000_000);
            if let Some(d) = parse_retry_after_at(&value, now) {
                prop_assert!(d <= MAX_RETRY_AFTER);
            }
        }

        #[test]
        fn every_status_has_one_class(status in any::<u16>()) {
            let class = classify_status(status);
            prop_assert_eq!(class == StatusClass::Success, (200..300).contains(&status));
        }
    }
}
