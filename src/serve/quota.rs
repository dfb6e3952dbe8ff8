//! Per-tenant limits on enqueued work (`serve.tenant_limits`), as
//! OpenAI's enqueued-token limit and LiteLLM's `batch_enqueued_token_limit`:
//! the requests and estimated tokens of a tenant's batches that have no
//! result yet. Pure: the limits, a batch's estimate and what it still
//! holds; the engine reads the store and reserves atomically
//! (`Engine::create`).
//!
//! A batch holds, from its creation, every request of its input file and
//! their estimated tokens (prompt estimate plus the output cap, as the
//! `tokens` unit charges: `crate::dispatch::cost`); each result (answer,
//! failure, expiry, cancel) releases one request and its share of the
//! tokens, and a batch that ends (or fails validation) releases the rest.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::config::Unit;
pub use crate::config::{TenantLimit, TenantLimits};
use crate::dispatch::cost::request_cost;

/// Requests and estimated tokens: what a batch holds against its tenant's
/// limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// Requests.
    pub requests: u64,
    /// Estimated tokens (prompt and output).
    pub tokens: u64,
}

impl Estimate {
    /// Adds one input line of a batch to `endpoint` (the request `body` of
    /// a batch line; `None` when the line does not parse: it still counts
    /// as a request, and validation will refuse the batch).
    pub fn add_line(&mut self, body: Option<&RawValue>, endpoint: &str) {
        self.requests += 1;
        let tokens = body.map_or(0, |b| request_cost(Unit::Tokens, b, Some(endpoint)));
        self.tokens = self.tokens.saturating_add(tokens);
    }

    /// What a batch that held `self` at creation still holds once `done`
    /// of its requests have a result: the requests without one, and the
    /// tokens in that proportion (rounded up, so a request left holds at
    /// least its share).
    pub fn remaining(self, done: u64) -> Self {
        let requests = self.requests.saturating_sub(done);
        let tokens = match self.requests {
            0 => 0,
            all => {
                let share = u128::from(self.tokens) * u128::from(requests);
                u64::try_from(share.div_ceil(u128::from(all))).unwrap_or(u64::MAX)
            }
        };
        Self { requests, tokens }
    }

    /// The sum of two holdings.
    pub fn plus(self, other: Self) -> Self {
        Self {
            requests: self.requests.saturating_add(other.requests),
            tokens: self.tokens.saturating_add(other.tokens),
        }
    }
}

/// Which limit a new batch would pass, with the figures for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exceeded {
    /// The limit passed.
    pub kind: LimitKind,
    /// Its value.
    pub limit: u64,
    /// What the tenant's batches hold now.
    pub held: u64,
    /// What the new batch asks.
    pub asked: u64,
}

/// The two limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// Enqueued requests.
    Requests,
    /// Enqueued estimated tokens.
    Tokens,
}

impl TenantLimit {
    /// Whether a batch asking `asked` fits beside `held`. A batch alone
    /// larger than a limit never fits: it is refused, not queued.
    pub fn admit(&self, held: Estimate, asked: Estimate) -> Result<(), Exceeded> {
        let checks = [
            (
                LimitKind::Requests,
                self.requests,
                held.requests,
                asked.requests,
            ),
            (LimitKind::Tokens, self.tokens, held.tokens, asked.tokens),
        ];
        for (kind, limit, held, asked) in checks {
            if let Some(limit) = limit
                && held.saturating_add(asked) > limit
            {
                return Err(Exceeded {
                    kind,
                    limit,
                    held,
                    asked,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn est(requests: u64, tokens: u64) -> Estimate {
        Estimate { requests, tokens }
    }

    #[test]
    fn a_batch_releases_requests_and_their_share_of_tokens_as_results_come() {
        let held = est(4, 10);
        assert_eq!(held.remaining(0), est(4, 10));
        assert_eq!(held.remaining(1), est(3, 8));
        assert_eq!(held.remaining(3), est(1, 3));
        assert_eq!(held.remaining(4), est(0, 0));
        assert_eq!(held.remaining(9), est(0, 0));
        assert_eq!(est(0, 0).remaining(0), est(0, 0));
    }

    #[test]
    fn line_estimates_reuse_the_token_cost() {
        let mut e = Estimate::default();
        let body =
            RawValue::from_string(r#"{"prompt":"abcdefgh","max_tokens":10}"#.into()).expect("json");
        e.add_line(Some(&body), "/v1/completions");
        e.add_line(None, "/v1/completions");
        assert_eq!(e, est(2, 12));
        // Embeddings generate nothing: their input alone.
        e.add_line(Some(&body), "/v1/embeddings");
        assert_eq!(e, est(3, 14));
    }

    #[test]
    fn overrides_fall_back_to_the_default_per_field() {
        let limits = TenantLimits {
            default: TenantLimit {
                requests: Some(10),
                tokens: Some(100),
            },
            tenants: [(
                "acme".to_owned(),
                TenantLimit {
                    requests: Some(2),
                    tokens: None,
                },
            )]
            .into(),
        };
        assert_eq!(
            limits.of("acme"),
            TenantLimit {
                requests: Some(2),
                tokens: Some(100)
            }
        );
        assert_eq!(limits.of("other"), limits.default);
        assert!(TenantLimits::default().of("x").is_unlimited());
    }

    #[test]
    fn admission_refuses_what_would_pass_a_limit() {
        let limit = TenantLimit {
            requests: Some(10),
            tokens: Some(100),
        };
        assert_eq!(limit.admit(est(5, 50), est(5, 50)), Ok(()));
        assert_eq!(
            limit.admit(est(5, 50), est(6, 1)),
            Err(Exceeded {
                kind: LimitKind::Requests,
                limit: 10,
                held: 5,
                asked: 6
            })
        );
        assert_eq!(
            limit.admit(est(0, 0), est(1, 101)).map_err(|e| e.kind),
            Err(LimitKind::Tokens)
        );
    }
}
