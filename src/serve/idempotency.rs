//! The Batch API's `Idempotency-Key` header on `POST /v1/files` and
//! `POST /v1/batches`: the first request under a key makes its object and
//! records `(fingerprint, object id)` under `(tenant, endpoint, key)`; a
//! repeat with the same fingerprint gets the same object back, another
//! fingerprint a conflict. Keys are scoped per tenant (API key), so one
//! tenant never learns of another's. A record whose object is gone
//! (deleted, expired, never made) is forgotten and the key made anew; one
//! whose object may still be in the making is waited for.

use axum::http::HeaderMap;

use super::store::{KeyRecord, Store, StoreError};

/// The header, as OpenAI's clients send it.
pub const HEADER: &str = "idempotency-key";

/// Longest key accepted (`crate::queue::idempotency::MAX_KEY_LEN`).
const MAX_KEY_LEN: usize = crate::queue::idempotency::MAX_KEY_LEN;

/// Which endpoint a key was used on: the same key on files and on
/// batches names two records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `POST /v1/files`.
    File,
    /// `POST /v1/batches`.
    Batch,
}

impl Scope {
    fn as_str(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Batch => "batch",
        }
    }
}

/// Where a key's record lives: a tenant's key on one endpoint.
#[derive(Debug, Clone, Copy)]
pub struct KeyName<'a> {
    /// The tenant (API key's name).
    pub tenant: &'a str,
    /// The endpoint.
    pub scope: Scope,
    /// The caller's key.
    pub key: &'a str,
}

/// What [`claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is now this request's: make the object under the id given.
    New,
    /// The same request made this object before: answer with it.
    Existing(String),
    /// The key made an object from another request.
    Conflict,
}

/// A header that cannot be a key.
#[derive(Debug, thiserror::Error)]
#[error("Idempotency-Key must be 1 to 256 visible ASCII characters")]
pub struct BadKey;

/// The request's `Idempotency-Key`, if it has one.
pub fn key(headers: &HeaderMap) -> Result<Option<String>, BadKey> {
    let Some(value) = headers.get(HEADER) else {
        return Ok(None);
    };
    let text = value.to_str().map_err(|_| BadKey)?;
    match !text.is_empty() && text.len() <= MAX_KEY_LEN {
        true => Ok(Some(text.to_owned())),
        false => Err(BadKey),
    }
}

/// How long a claimed key's object may take to appear. The claimer
/// records the key before it makes the object, so a record without its
/// object is either in the making (a concurrent request under the same
/// key: a caller that retried while its first request ran) or left by a
/// claimer that died in between. A younger record is waited for; an older
/// one is taken for the second kind and forgotten. Making an object is a
/// file rename and a store write, or a batch's record: milliseconds, so
/// this is a wide margin for a loaded store.
const MAKING_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a request waiting for a key's object in the making looks.
const MAKING_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Claims the key `name` for `object_id` made from a
/// request with `fingerprint`, or finds what it records. `exists` tells
/// whether a recorded object is there. A record without its object is
/// waited for while it may be in the making (younger than
/// [`MAKING_GRACE`]; the same request's object is then returned, another
/// request's is a conflict at once); after that it is forgotten and the
/// key claimed again. `expires_at` bounds the record by its object's life
/// (a file's expiry).
pub async fn claim<F, Fut>(
    store: &Store,
    name: KeyName<'_>,
    fingerprint: &str,
    object_id: &str,
    expires_at: Option<i64>,
    exists: F,
) -> Result<Claim, StoreError>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<bool, StoreError>>,
{
    let KeyName { tenant, scope, key } = name;
    let record = KeyRecord {
        fingerprint: fingerprint.to_owned(),
        object_id: object_id.to_owned(),
        claimed_at_ms: crate::clock::unix_millis(),
    };
    // Bounded by the local clock too: another replica's may be ahead.
    let give_up = std::time::Instant::now() + MAKING_GRACE;
    let mut forgotten = false;
    loop {
        let found = (store.claim_key(tenant, scope.as_str(), key, &record, expires_at)).await?;
        let Some(found) = found else {
            return Ok(Claim::New);
        };
        let same = found.fingerprint == fingerprint;
        if exists(found.object_id.clone()).await? {
            return Ok(match same {
                true => Claim::Existing(found.object_id),
                false => Claim::Conflict,
            });
        }
        let age_ms = crate::clock::unix_millis().saturating_sub(found.claimed_at_ms);
        let young = u128::try_from(age_ms).unwrap_or(0) < MAKING_GRACE.as_millis();
        if young && std::time::Instant::now() < give_up {
            if !same {
                return Ok(Claim::Conflict);
            }
            tokio::time::sleep(MAKING_POLL).await;
            continue;
        }
        // Once at most: a second record without its object is a rival's
        // claim that failed as well.
        if forgotten {
            return Ok(Claim::Conflict);
        }
        store.forget_key(tenant, scope.as_str(), key).await?;
        forgotten = true;
    }
}

/// Gives the key up after the object could not be made, so a retry can.
pub async fn release(
    store: &Store,
    tenant: &str,
    scope: Scope,
    key: &str,
) -> Result<(), StoreError> {
    store.forget_key(tenant, scope.as_str(), key).await
}
