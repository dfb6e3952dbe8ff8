//! Which headers sluicegate never sends on a message's behalf, and which
//! may be passed through from a client: the one rule for the gateway
//! client (a message's headers), the config (`dispatch.merge_priority_header`)
//! and `serve` (`serve.pass_headers`). Pure, no I/O.

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderName};

/// Headers a message may not set: they control framing, the connection or
/// routing through proxies (so a message could smuggle a second request or
/// reach another host), plus `Authorization` when the gateway token is
/// configured. `expect` is included because `100-continue` changes how the
/// body is sent.
pub fn is_forbidden(name: &HeaderName, bearer_configured: bool) -> bool {
    let name = name.as_str();
    matches!(
        name,
        "host"
            | "content-length"
            | "transfer-encoding"
            | "connection"
            | "upgrade"
            | "te"
            | "trailer"
            | "keep-alive"
            | "expect"
    ) || name.starts_with("proxy-")
        || (bearer_configured && name == AUTHORIZATION.as_str())
}

/// Whether a header of a client's request may be passed on to the gateway
/// with every request of its batch (`serve.pass_headers`): not one the
/// client sets itself or refuses from a message (framing, routing), not a
/// credential (the Batch API's own `Authorization` is the caller's key),
/// and not `Content-Type`, which is the body's.
pub fn may_pass_through(name: &HeaderName) -> bool {
    !is_forbidden(name, true) && !is_secret(name) && name != CONTENT_TYPE
}

/// Headers whose values are credentials and must print as "Sensitive".
pub fn is_secret(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "authorization" | "cookie" | "x-api-key" | "api-key"
    )
}
