//! A request the simulator refuses with 400: what every endpoint's parser
//! returns (`http.rs` turns it into OpenAI's error body), apart from the
//! server so the parsers in `endpoints.rs` need not import it.

/// A 400 answer, kept small so `Result`s carrying it stay cheap.
#[derive(Debug)]
pub(super) struct BadRequest {
    pub(super) message: String,
    pub(super) param: Option<&'static str>,
}

pub(super) fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> BadRequest {
    BadRequest {
        message: message.into(),
        param,
    }
}
