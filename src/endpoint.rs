//! The endpoints a batch may name, and what each one's request body must
//! hold before it is worth sending. The check is deliberately shallow (the
//! fields without which no server could answer): the gateway judges the
//! rest, and its 4xx answer lands in the error file like any other answer.
//!
//! Known: OpenAI's four batch endpoints, and vLLM's pooling-model ones
//! (`/v1/rerank`, `/v1/score`, `/classify`, `/pooling`). Which of them a
//! deployment takes is configuration ([`Endpoints`]: `serve.endpoints`,
//! `batch --endpoints`), defaulting to OpenAI's four; a configured path we
//! do not know is sent as it is, with no body check.

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
    /// `/v1/rerank` (vLLM): documents ranked against a query.
    Rerank,
    /// `/v1/score` (vLLM): a score per text pair.
    Score,
    /// `/classify` (vLLM): class probabilities per input.
    Classify,
    /// `/pooling` (vLLM): pooled hidden states per input.
    Pooling,
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
    /// OpenAI's batch endpoints, in OpenAI's order: the default list.
    pub const OPENAI: [Self; 4] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Embeddings,
        Self::Responses,
    ];

    /// Every endpoint we know.
    pub const ALL: [Self; 8] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Embeddings,
        Self::Responses,
        Self::Rerank,
        Self::Score,
        Self::Classify,
        Self::Pooling,
    ];

    /// The URL path, as batch lines and `POST /v1/batches` spell it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Embeddings => "/v1/embeddings",
            Self::Responses => "/v1/responses",
            Self::Rerank => "/v1/rerank",
            Self::Score => "/v1/score",
            Self::Classify => "/classify",
            Self::Pooling => "/pooling",
        }
    }

    /// The endpoint of a URL path; `None` for one we do not know.
    pub fn parse(path: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == path)
    }

    /// Whether the endpoint generates tokens; the others only read their
    /// input (a prefill), so a token window charges them the input alone.
    pub const fn generates(self) -> bool {
        matches!(
            self,
            Self::ChatCompletions | Self::Completions | Self::Responses
        )
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
            // vLLM's pooling endpoints: the texts they read (vLLM fills in
            // the served model when `model` is absent).
            Self::Rerank => {
                match body.get("query") {
                    Some(Value::String(q)) if !q.is_empty() => {}
                    _ => {
                        return Err(refuse(
                            "body.query",
                            "body.query is required and must be a non-empty string",
                        ));
                    }
                }
                texts(body, "documents", "body.documents")
            }
            Self::Score => {
                texts(body, "text_1", "body.text_1")?;
                texts(body, "text_2", "body.text_2")
            }
            Self::Classify | Self::Pooling => texts(body, "input", "body.input"),
        }
    }
}

/// `field`: a non-empty string or a non-empty array of non-empty strings.
fn texts(body: &Map<String, Value>, field: &str, param: &'static str) -> Result<(), BodyError> {
    let ok = match body.get(field) {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(items)) => {
            !items.is_empty()
                && items
                    .iter()
                    .all(|i| i.as_str().is_some_and(|s| !s.is_empty()))
        }
        _ => false,
    };
    match ok {
        true => Ok(()),
        false => Err(refuse(
            param,
            &format!(
                "{param} is required: a non-empty string or a non-empty array of non-empty strings"
            ),
        )),
    }
}

/// The endpoints a deployment takes, in its configured order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints(Vec<String>);

impl Default for Endpoints {
    /// OpenAI's four.
    fn default() -> Self {
        Self(
            Endpoint::OPENAI
                .iter()
                .map(|e| e.as_str().to_owned())
                .collect(),
        )
    }
}

impl Endpoints {
    /// A configured list: paths starting with `/`, without a query or
    /// spaces, none twice, at least one.
    pub fn new(paths: &[String]) -> Result<Self, String> {
        if paths.is_empty() {
            return Err("at least one endpoint path is required".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for p in paths {
            if !p.starts_with('/') || p.contains(['?', '#', ' ']) {
                return Err(format!(
                    "`{p}` is not a path (it must start with '/', without a query); known: {}",
                    known_paths()
                ));
            }
            if !seen.insert(p.as_str()) {
                return Err(format!("`{p}` is listed twice"));
            }
        }
        Ok(Self(paths.to_vec()))
    }

    /// Whether a batch may name `path`.
    pub fn allows(&self, path: &str) -> bool {
        self.0.iter().any(|p| p == path)
    }

    /// The configured paths.
    pub fn paths(&self) -> &[String] {
        &self.0
    }

    /// Checks a request to `path` with `body`: the path must be listed,
    /// and a known endpoint's body must hold what it needs.
    pub fn check(&self, path: &str, body: Option<&Map<String, Value>>) -> Result<(), BodyError> {
        if !self.allows(path) {
            return Err(BodyError {
                param: "url",
                message: format!(
                    "endpoint {path} is not served here; allowed: {}",
                    self.0.join(", ")
                ),
            });
        }
        match (Endpoint::parse(path), body) {
            (Some(endpoint), Some(body)) => endpoint.check_body(body),
            _ => Ok(()),
        }
    }
}

/// Every known path, for error messages.
pub fn known_paths() -> String {
    Endpoint::ALL.map(Endpoint::as_str).join(", ")
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
    fn pooling_endpoints_need_the_texts_they_read() {
        assert_eq!(
            check(
                Endpoint::Rerank,
                json!({"query": "q", "documents": ["a", "b"]})
            ),
            Ok(())
        );
        let e = check(Endpoint::Rerank, json!({"documents": ["a"]})).expect_err("no query");
        assert_eq!(e.param, "body.query");
        let e = check(Endpoint::Rerank, json!({"query": "q", "documents": []})).expect_err("none");
        assert_eq!(e.param, "body.documents");
        assert_eq!(
            check(
                Endpoint::Score,
                json!({"text_1": "a", "text_2": ["b", "c"]})
            ),
            Ok(())
        );
        let e = check(Endpoint::Score, json!({"text_1": "a"})).expect_err("no text_2");
        assert_eq!(e.param, "body.text_2");
        for e in [Endpoint::Classify, Endpoint::Pooling] {
            assert_eq!(check(e, json!({"input": ["a"]})), Ok(()));
            assert_eq!(
                check(e, json!({"input": [""]})).map_err(|e| e.param),
                Err("body.input")
            );
        }
    }

    #[test]
    fn a_configured_list_allows_its_paths_and_checks_known_bodies() {
        let defaults = Endpoints::default();
        assert!(defaults.allows("/v1/chat/completions") && !defaults.allows("/v1/rerank"));
        let list = Endpoints::new(&["/v1/rerank".into(), "/v1/custom".into()]).expect("valid");
        let body = json!({"query": "q"});
        let e = list
            .check("/v1/rerank", body.as_object())
            .expect_err("no documents");
        assert_eq!(e.param, "body.documents");
        assert_eq!(
            list.check("/v1/custom", body.as_object()),
            Ok(()),
            "unknown paths go as they are"
        );
        let e = list.check("/v1/completions", None).expect_err("not listed");
        assert!(
            e.message.contains("allowed: /v1/rerank, /v1/custom"),
            "{e:?}"
        );
        assert!(Endpoints::new(&[]).is_err());
        assert!(Endpoints::new(&["v1/rerank".into()]).is_err());
        assert!(Endpoints::new(&["/a".into(), "/a".into()]).is_err());
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
