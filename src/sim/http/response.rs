//! Generation endpoints: submit, wait for tokens, answer unary or as a
//! server-sent event stream in OpenAI's shapes.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rand_distr::{Distribution, LogNormal};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::*;
use crate::sim::endpoints::{ResponseIds, embeddings_body, response_body};
use crate::sim::engine::{Outcome, RequestClass, RequestRecord, SimRequest};
use crate::sim::pool::Admission;
use crate::sim::scoring::{PoolingApi, pooling_body};

pub(super) async fn completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Completions, body).await
}

pub(super) async fn chat_completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Chat, body).await
}

pub(super) async fn embeddings(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Embeddings, body).await
}

pub(super) async fn responses(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Responses, body).await
}

pub(super) async fn rerank(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Pooling(PoolingApi::Rerank), body).await
}

pub(super) async fn score(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Pooling(PoolingApi::Score), body).await
}

pub(super) async fn classify(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Pooling(PoolingApi::Classify), body).await
}

pub(super) async fn pooling(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Pooling(PoolingApi::Pooling), body).await
}

/// Aborts the simulated request if the handler (or stream) goes away early.
pub(super) struct AbortGuard {
    shared: Arc<Shared>,
    id: u64,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            let mut live = self.shared.lock();
            live.waiters.remove(&self.id);
            live.pool.abort(self.id);
        }
    }
}

pub(super) const FILLER: [&str; 10] = [
    " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
];

pub(super) fn filler(n: u32) -> String {
    (0..n).map(|i| FILLER[i as usize % FILLER.len()]).collect()
}

pub(super) async fn handle(s: Arc<Shared>, api: Api, body: Bytes) -> Response {
    let p = match parse(api, &body, &s.cfg) {
        Ok(p) => p,
        Err(bad) => return bad.into_response(),
    };
    let (id, target, rx, admission) = {
        let mut live = s.lock();
        let now = s.now();
        live.advance(now);
        let cap = p.max_tokens.min(s.cfg.http.max_output_tokens);
        let output = if s.cfg.http.draw_output {
            // Validated mean >= 1; cv 0.6 like the load generators.
            match LogNormal::from_mean_cv(s.cfg.http.output_mean, 0.6) {
                Ok(d) => (d.sample(&mut live.output_rng).round() as u32).clamp(1, cap),
                Err(_) => cap,
            }
        } else {
            cap
        };
        let req = SimRequest {
            id: live.next_id,
            class: RequestClass::Interactive,
            arrival: now,
            prompt_tokens: p.prompt_tokens,
            output_tokens: output,
            max_tokens: p.max_tokens,
            priority: p.priority,
            stream: p.stream,
            prefix: p.prefix.clone(),
        };
        live.next_id += 1;
        let target = req.target_output();
        let (tx, rx) = mpsc::channel(target as usize + 2);
        live.waiters.insert(req.id, tx);
        let id = req.id;
        let admission = live.pool.submit(req);
        if let Admission::Rejected(_) = admission {
            live.waiters.remove(&id);
        }
        (id, target, rx, admission)
    };
    match admission {
        Admission::Rejected(429) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "the pool is saturated; retry later",
                "rate_limit_error",
                None,
            );
        }
        Admission::Rejected(_) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is overloaded; retry later",
                "server_error",
                None,
            );
        }
        Admission::Routed(_) | Admission::Held => {}
    }
    s.wake.notify_one();
    let guard = AbortGuard {
        shared: s.clone(),
        id,
        done: false,
    };
    let replica = match admission {
        Admission::Routed(i) => Some(i),
        _ => None,
    };
    let ids = ResponseIds {
        id: match api {
            Api::Completions => format!("cmpl-{id}"),
            Api::Chat => format!("chatcmpl-{id}"),
            Api::Embeddings => format!("embd-{id}"),
            Api::Responses => format!("resp_{id}"),
            Api::Pooling(kind) => format!("{}-{id}", kind.id_prefix()),
        },
        created: s.created,
        model: p.model.clone(),
    };
    let mut resp = if p.stream {
        stream_response(api, ids, p, target, rx, guard)
    } else {
        unary_response(api, ids, p, rx, guard).await
    };
    if let Some(i) = replica
        && let Ok(v) = HeaderValue::from_str(&format!("{}-{i}", s.cfg.pool_name))
    {
        resp.headers_mut().insert("x-sim-replica", v);
    }
    resp
}

pub(super) fn usage(prompt: u32, completion: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

pub(super) fn finish_reason(generated: u32, max_tokens: u32) -> &'static str {
    if generated >= max_tokens {
        "length"
    } else {
        "stop"
    }
}

pub(super) fn refused(rec: &RequestRecord) -> Option<Response> {
    match rec.outcome {
        Outcome::Rejected429 => Some(error(
            StatusCode::TOO_MANY_REQUESTS,
            "the pool is saturated; retry later",
            "rate_limit_error",
            None,
        )),
        Outcome::Rejected503 | Outcome::Aborted | Outcome::Unfinished => Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is overloaded; retry later",
            "server_error",
            None,
        )),
        Outcome::Completed => None,
    }
}

pub(super) async fn unary_response(
    api: Api,
    ids: ResponseIds,
    p: Parsed,
    mut rx: mpsc::Receiver<Ev>,
    mut guard: AbortGuard,
) -> Response {
    let rec = loop {
        match rx.recv().await {
            Some(Ev::Token(_)) => {}
            Some(Ev::Done(rec)) => break rec,
            None => {
                guard.done = true;
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "simulator shutting down",
                    "server_error",
                    None,
                );
            }
        }
    };
    guard.done = true;
    if let Some(resp) = refused(&rec) {
        return resp;
    }
    let text = filler(rec.output_tokens);
    let reason = finish_reason(rec.output_tokens, p.max_tokens);
    let choice = match api {
        Api::Completions => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
        }
        Api::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": reason,
        }),
        Api::Embeddings => {
            let Some(embed) = &p.embed else {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "embeddings request without its vectors",
                    "server_error",
                    None,
                );
            };
            return axum::Json(embeddings_body(&ids.model, embed, rec.prompt_tokens))
                .into_response();
        }
        Api::Pooling(_) => {
            let Some(pooling) = &p.pooling else {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "pooling request without its items",
                    "server_error",
                    None,
                );
            };
            let body = pooling_body(&ids.id, ids.created, &ids.model, pooling, rec.prompt_tokens);
            return axum::Json(body).into_response();
        }
        Api::Responses => {
            let body = response_body(
                &ids,
                &text,
                rec.prompt_tokens,
                rec.output_tokens,
                p.max_tokens,
            );
            return axum::Json(body).into_response();
        }
    };
    axum::Json(json!({
        "id": ids.id,
        "object": if api == Api::Chat { "chat.completion" } else { "text_completion" },
        "created": ids.created,
        "model": ids.model,
        "choices": [choice],
        "usage": usage(rec.prompt_tokens, rec.output_tokens),
    }))
    .into_response()
}

pub(super) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub(super) fn stream_response(
    api: Api,
    ids: ResponseIds,
    p: Parsed,
    target: u32,
    rx: mpsc::Receiver<Ev>,
    guard: AbortGuard,
) -> Response {
    let object = if api == Api::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = move |ids: &ResponseIds, choice: Value| {
        sse(&json!({
            "id": ids.id,
            "object": object,
            "created": ids.created,
            "model": ids.model,
            "choices": [choice],
        }))
    };
    struct St {
        rx: mpsc::Receiver<Ev>,
        guard: AbortGuard,
        ids: ResponseIds,
        p: Parsed,
        target: u32,
        started: bool,
        finished: bool,
    }
    let st = St {
        rx,
        guard,
        ids,
        p,
        target,
        started: false,
        finished: false,
    };
    let body = futures_util::stream::unfold(st, move |mut st| async move {
        if st.finished {
            return None;
        }
        if api == Api::Chat && !st.started {
            st.started = true;
            let c = chunk(
                &st.ids,
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            );
            return Some((Ok::<Bytes, Infallible>(c), st));
        }
        st.started = true;
        match st.rx.recv().await {
            Some(Ev::Token(i)) => {
                let word = FILLER[i as usize % FILLER.len()];
                let last = i + 1 >= st.target;
                let reason = if last {
                    json!(finish_reason(st.target, st.p.max_tokens))
                } else {
                    Value::Null
                };
                let choice = match api {
                    // `parse` refuses streaming for responses and ignores
                    // it for embeddings: only completions and chat stream.
                    Api::Completions | Api::Embeddings | Api::Responses | Api::Pooling(_) => {
                        json!({"index": 0, "text": word, "logprobs": null, "finish_reason": reason})
                    }
                    Api::Chat => {
                        json!({"index": 0, "delta": {"content": word}, "logprobs": null, "finish_reason": reason})
                    }
                };
                Some((Ok(chunk(&st.ids, choice)), st))
            }
            Some(Ev::Done(rec)) => {
                st.guard.done = true;
                st.finished = true;
                let mut out = Vec::new();
                if rec.outcome != Outcome::Completed {
                    out.extend_from_slice(&sse(&json!({"error": {"message": "request refused or aborted by the pool", "type": "server_error", "code": 503}})));
                } else if st.p.include_usage {
                    out.extend_from_slice(&sse(&json!({
                        "id": st.ids.id,
                        "object": object,
                        "created": st.ids.created,
                        "model": st.ids.model,
                        "choices": [],
                        "usage": usage(rec.prompt_tokens, rec.output_tokens),
                    })));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                Some((Ok(Bytes::from(out)), st))
            }
            // Server shutting down: end the stream without [DONE].
            None => None,
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot build stream",
                "server_error",
                None,
            )
        })
}
