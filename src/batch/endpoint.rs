//! The endpoints an OpenAI batch may name, and what each one's request
//! body must hold before it is worth sending. The check is deliberately
//! shallow (the fields without which no server could answer): the gateway
//! judges the rest, and its 4xx answer lands in the error file like any
//! other answer.

use serde_json::{Map, Value};

/// An endpoint of OpenAI's batch list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/completions`.
    Completions,
    /// `/v1/embeddings`.
    Embeddings,
    /// `/v1/responses`.
    Responses,
}

/// Why a request body does not fit its endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyError {
    /// The offending field, as OpenAI names it in batch errors
    /// (`body.input`).
    pub param: &'static str,
    /// What is wrong.
    pub message: String,
}

impl Endpoint {
    /// Every endpoint, in OpenAI's order.
    pub const ALL: [Self; 4] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Embeddings,
        Self::Responses,
    ];

    /// The URL path, as batch lines and `POST /v1/batches` spell it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Embeddings => "/v1/embeddings",
            Self::Responses => "/v1/responses",
        }
    }

    /// The endpoint of a URL path; `None` for one OpenAI batches do not take.
    pub fn parse(path: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == path)
    }

    /// Checks the fields this endpoint cannot do without: embeddings need
    /// `model` and an `input` of text or tokens, responses `model` and an
    /// `input` of text or items. Chat and text completions are left to the
    /// gateway, as before (their bodies vary across servers, and a body the
    /// gateway refuses is answered in the error file).
    pub fn check_body(self, body: &Map<String, Value>) -> Result<(), BodyError> {
        match self {
            Self::ChatCompletions | Self::Completions => Ok(()),
            Self::Embeddings => {
                model(body)?;
                embedding_input(body.get("input"))
            }
            Self::Responses => {
                model(body)?;
                response_input(body.get("input"))
            }
        }
    }
}

fn refuse(param: &'static str, message: &str) -> BodyError {
    BodyError {
        param,
        message: message.to_owned(),
    }
}

/// `model`: a non-empty string.
fn model(body: &Map<String, Value>) -> Result<(), BodyError> {
    match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Ok(()),
        Some(_) => Err(refuse(
            "body.model",
            "body.model must be a non-empty string",
        )),
        None => Err(refuse("body.model", "body.model is required")),
    }
}

/// Whether `v` is a token id (a non-negative integer).
fn token(v: &Value) -> bool {
    v.as_u64().is_some()
}

/// Embeddings `input`: a string, an array of strings, an array of token
/// ids, or an array of token arrays (OpenAI's four forms), none empty.
fn embedding_input(input: Option<&Value>) -> Result<(), BodyError> {
    const FORMS: &str =
        "a string, an array of strings, an array of token ids or an array of token arrays";
    let bad = || {
        refuse(
            "body.input",
            &format!("body.input must be {FORMS}, none of them empty"),
        )
    };
    match input {
        None => Err(refuse(
            "body.input",
            &format!("body.input is required ({FORMS})"),
        )),
        Some(Value::String(s)) if !s.is_empty() => Ok(()),
        Some(Value::Array(items)) if !items.is_empty() => {
            let strings = items
                .iter()
                .all(|i| i.as_str().is_some_and(|s| !s.is_empty()));
            let tokens = items.iter().all(token);
            let token_arrays = items.iter().all(|i| {
                i.as_array()
                    .is_some_and(|t| !t.is_empty() && t.iter().all(token))
            });
            match strings || tokens || token_arrays {
                true => Ok(()),
                false => Err(bad()),
            }
        }
        Some(_) => Err(bad()),
    }
}

/// Responses `input`: a non-empty string, or a non-empty array of input
/// items (objects: messages, function outputs and the like).
fn response_input(input: Option<&Value>) -> Result<(), BodyError> {
    const FORMS: &str = "a string or an array of input items (objects)";
    match input {
        None => Err(refuse(
            "body.input",
            &format!("body.input is required ({FORMS})"),
        )),
        Some(Value::String(s)) if !s.is_empty() => Ok(()),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_object) => {
            Ok(())
        }
        Some(_) => Err(refuse(
            "body.input",
            &format!("body.input must be {FORMS}, not empty"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(endpoint: Endpoint, body: Value) -> Result<(), BodyError> {
        endpoint.check_body(body.as_object().expect("an object"))
    }

    #[test]
    fn paths_round_trip_and_unknown_ones_are_none() {
        for e in Endpoint::ALL {
            assert_eq!(Endpoint::parse(e.as_str()), Some(e));
        }
        assert_eq!(Endpoint::parse("/v1/audio/speech"), None);
        assert_eq!(Endpoint::parse("/v1/embeddings/"), None);
    }

    #[test]
    fn embeddings_take_openais_four_input_forms() {
        for input in [
            json!("text"),
            json!(["a", "b"]),
            json!([1, 2, 3]),
            json!([[1, 2], [3]]),
        ] {
            assert_eq!(
                check(Endpoint::Embeddings, json!({"model": "m", "input": input})),
                Ok(()),
                "{input}"
            );
        }
        for input in [
            json!(""),
            json!([]),
            json!(["a", 1]),
            json!([[1], []]),
            json!([-1]),
            json!([["a"]]),
            json!({"text": "a"}),
            json!(3),
        ] {
            let e = check(Endpoint::Embeddings, json!({"model": "m", "input": input}))
                .expect_err("refused");
            assert_eq!(e.param, "body.input", "{input}");
        }
        let e = check(Endpoint::Embeddings, json!({"model": "m"})).expect_err("no input");
        assert!(e.message.contains("required"), "{e:?}");
        let e = check(Endpoint::Embeddings, json!({"input": "x"})).expect_err("no model");
        assert_eq!(e.param, "body.model");
        let e = check(Endpoint::Embeddings, json!({"model": 5, "input": "x"})).expect_err("bad");
        assert_eq!(e.param, "body.model");
    }

    #[test]
    fn responses_take_text_or_input_items() {
        for input in [
            json!("hi"),
            json!([{"role": "user", "content": "hi"}]),
            json!([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]),
        ] {
            assert_eq!(
                check(Endpoint::Responses, json!({"model": "m", "input": input})),
                Ok(())
            );
        }
        for input in [json!(""), json!([]), json!(["hi"]), json!(7)] {
            let e = check(Endpoint::Responses, json!({"model": "m", "input": input}))
                .expect_err("refused");
            assert_eq!(e.param, "body.input", "{input}");
        }
        let e = check(Endpoint::Responses, json!({"input": "hi"})).expect_err("no model");
        assert_eq!(e.param, "body.model");
    }

    #[test]
    fn completions_bodies_are_left_to_the_gateway() {
        assert_eq!(check(Endpoint::Completions, json!({})), Ok(()));
        assert_eq!(
            check(Endpoint::ChatCompletions, json!({"model": 5})),
            Ok(())
        );
    }
}
