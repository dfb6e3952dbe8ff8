//! vLLM's pooling-model endpoints on the HTTP front: `/v1/rerank`,
//! `/v1/score`, `/classify` and `/pooling`. How their bodies become prompt
//! lengths, and the objects (vLLM's shapes) they are answered with. The
//! pool sees each as an embedding does: a prefill whose single engine step
//! ends it. Scores, labels and vectors are drawn from the text's hash, so
//! the same input always gets the same answer.

use serde_json::{Map, Value, json};

use super::bad_request::{BadRequest, bad_request};

/// Which pooling endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PoolingApi {
    /// `/v1/rerank` (also `/rerank`, `/v2/rerank`): documents ordered by
    /// relevance to a query.
    Rerank,
    /// `/v1/score` (also `/score`): a score per text pair.
    Score,
    /// `/classify`: class probabilities per input.
    Classify,
    /// `/pooling`: the pooled hidden state per input.
    Pooling,
}

impl PoolingApi {
    /// The prefix of the answer's id.
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Self::Rerank => "rerank",
            Self::Score => "score",
            Self::Classify => "classify",
            Self::Pooling => "pool",
        }
    }
}

/// A validated pooling request: one item per answer entry.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PoolingRequest {
    api: PoolingApi,
    /// One seed per item (a document, a pair, an input), from its text.
    seeds: Vec<u64>,
    /// Rerank: the documents, echoed in the answer.
    documents: Vec<String>,
    /// Rerank: how many results to return (`top_n`; all when unset).
    top_n: Option<usize>,
    /// Prompt tokens over every item.
    pub(super) tokens: u64,
}

fn fnv(parts: &[&str]) -> u64 {
    let mut h = crate::prompt::FNV_OFFSET;
    for p in parts {
        h = crate::prompt::fnv1a(h, p.as_bytes());
        h = crate::prompt::fnv1a(h, &[0]);
    }
    h
}

/// A number in [0, 1) from a seed (splitmix64's finalizer).
fn unit(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// A non-empty string, or a non-empty array of non-empty strings.
fn texts<'a>(obj: &'a Map<String, Value>, field: &'static str) -> Result<Vec<&'a str>, BadRequest> {
    let bad = || {
        bad_request(
            format!("{field} must be a non-empty string or a non-empty array of non-empty strings"),
            Some(field),
        )
    };
    match obj.get(field) {
        None | Some(Value::Null) => Err(bad_request(format!("{field} is required"), Some(field))),
        Some(Value::String(s)) if !s.is_empty() => Ok(vec![s.as_str()]),
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|i| i.as_str().filter(|s| !s.is_empty()).ok_or_else(bad))
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// Reads a pooling body (`text_tokens` estimates a text's tokens).
pub(super) fn pooling_request(
    api: PoolingApi,
    obj: &Map<String, Value>,
    text_tokens: impl Fn(&str) -> u64,
) -> Result<PoolingRequest, BadRequest> {
    let mut request = PoolingRequest {
        api,
        seeds: Vec::new(),
        documents: Vec::new(),
        top_n: None,
        tokens: 0,
    };
    match api {
        PoolingApi::Rerank => {
            let query = match obj.get("query") {
                Some(Value::String(q)) if !q.is_empty() => q.as_str(),
                _ => {
                    return Err(bad_request(
                        "query is required and must be a non-empty string",
                        Some("query"),
                    ));
                }
            };
            let documents = texts(obj, "documents")?;
            request.top_n = match obj.get("top_n") {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_u64().filter(|n| *n >= 1) {
                    Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
                    None => {
                        return Err(bad_request("top_n must be an integer >= 1", Some("top_n")));
                    }
                },
            };
            // Each document is read beside the query (a cross-encoder).
            for d in documents {
                request.seeds.push(fnv(&[query, d]));
                request.tokens += text_tokens(query) + text_tokens(d);
                request.documents.push(d.to_owned());
            }
        }
        PoolingApi::Score => {
            let (left, right) = (texts(obj, "text_1")?, texts(obj, "text_2")?);
            // vLLM's pairing: one against many, or one to one.
            let pairs: Vec<(&str, &str)> = match (left.len(), right.len()) {
                (1, _) => right.iter().map(|r| (left[0], *r)).collect(),
                (l, r) if l == r => left.iter().copied().zip(right.iter().copied()).collect(),
                (l, r) => {
                    return Err(bad_request(
                        format!(
                            "text_1 ({l} texts) and text_2 ({r}) must pair one to one, or text_1 must be one text"
                        ),
                        Some("text_2"),
                    ));
                }
            };
            for (a, b) in pairs {
                request.seeds.push(fnv(&[a, b]));
                request.tokens += text_tokens(a) + text_tokens(b);
            }
        }
        PoolingApi::Classify | PoolingApi::Pooling => {
            for t in texts(obj, "input")? {
                request.seeds.push(fnv(&[t]));
                request.tokens += text_tokens(t);
            }
        }
    }
    Ok(request)
}

/// The answer to a pooling request, in vLLM's shape.
pub(super) fn pooling_body(
    id: &str,
    created: u64,
    model: &str,
    request: &PoolingRequest,
    prompt_tokens: u32,
) -> Value {
    let usage = json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0});
    let seeds = request.seeds.iter().copied().enumerate();
    match request.api {
        PoolingApi::Rerank => {
            let mut results: Vec<Value> = seeds
                .map(|(index, seed)| {
                    json!({
                        "index": index,
                        "document": {"text": request.documents[index]},
                        "relevance_score": unit(seed),
                    })
                })
                .collect();
            results.sort_by(|a, b| {
                let score = |v: &Value| v["relevance_score"].as_f64().unwrap_or(0.0);
                score(b).total_cmp(&score(a))
            });
            results.truncate(request.top_n.unwrap_or(usize::MAX));
            json!({"id": id, "model": model, "usage": {"total_tokens": prompt_tokens}, "results": results})
        }
        PoolingApi::Score => {
            let data: Vec<Value> = seeds
                .map(
                    |(index, seed)| json!({"index": index, "object": "score", "score": unit(seed)}),
                )
                .collect();
            json!({"id": id, "object": "list", "created": created, "model": model, "data": data, "usage": usage})
        }
        PoolingApi::Classify => {
            let data: Vec<Value> = seeds
                .map(|(index, seed)| {
                    let p = unit(seed);
                    let label = if p >= 0.5 { "LABEL_1" } else { "LABEL_0" };
                    json!({"index": index, "label": label, "probs": [1.0 - p, p], "num_classes": 2})
                })
                .collect();
            json!({"id": id, "object": "list", "created": created, "model": model, "data": data, "usage": usage})
        }
        PoolingApi::Pooling => {
            let data: Vec<Value> = seeds
                .map(|(index, seed)| {
                    let v: Vec<f64> = (0..super::endpoints::DEFAULT_DIMENSIONS as u64)
                        .map(|k| unit(seed.wrapping_add(k)) * 2.0 - 1.0)
                        .collect();
                    json!({"index": index, "object": "pooling", "data": v})
                })
                .collect();
            json!({"id": id, "object": "list", "created": created, "model": model, "data": data, "usage": usage})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    fn tokens(s: &str) -> u64 {
        s.len().div_ceil(4) as u64
    }

    #[test]
    fn rerank_orders_by_relevance_keeps_top_n_and_counts_query_per_document() {
        let req = pooling_request(
            PoolingApi::Rerank,
            &obj(json!({"query": "abcd", "documents": ["x", "yyyy", "zz"], "top_n": 2})),
            tokens,
        )
        .expect("valid");
        // The 1-token query beside each of 3 one-token documents.
        assert_eq!(req.tokens, 3 + 3);
        let body = pooling_body("r", 0, "m", &req, 6);
        let results = body["results"].as_array().expect("results");
        assert_eq!(results.len(), 2);
        let s = |i: usize| results[i]["relevance_score"].as_f64().expect("score");
        assert!(s(0) >= s(1));
        let again = pooling_body("r", 0, "m", &req, 6);
        assert_eq!(body, again, "the same input gets the same answer");
    }

    #[test]
    fn score_pairs_one_to_many_or_one_to_one_and_refuses_the_rest() {
        let one_many = pooling_request(
            PoolingApi::Score,
            &obj(json!({"text_1": "q", "text_2": ["a", "b", "c"]})),
            tokens,
        )
        .expect("valid");
        assert_eq!(
            pooling_body("s", 0, "m", &one_many, 6)["data"]
                .as_array()
                .map(Vec::len),
            Some(3)
        );
        assert!(
            pooling_request(
                PoolingApi::Score,
                &obj(json!({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})),
                tokens
            )
            .is_err()
        );
    }

    #[test]
    fn classify_and_pooling_need_an_input() {
        for api in [PoolingApi::Classify, PoolingApi::Pooling] {
            assert!(pooling_request(api, &obj(json!({"model": "m"})), tokens).is_err());
            assert!(pooling_request(api, &obj(json!({"input": [""]})), tokens).is_err());
            let ok =
                pooling_request(api, &obj(json!({"input": ["a", "bb"]})), tokens).expect("valid");
            let body = pooling_body("c", 0, "m", &ok, 2);
            assert_eq!(body["data"].as_array().map(Vec::len), Some(2));
        }
    }
}
