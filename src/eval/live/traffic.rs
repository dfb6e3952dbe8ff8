//! The live eval's traffic: seeded interactive arrivals and prompts (pure),
//! the batch file, and one streamed interactive request timed at the
//! client (I/O).

use std::time::Duration;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde_json::json;
use tokio::time::Instant;

use super::figures::{Timing, itl_p95};
use crate::sim::load::exp_sample;

/// The interactive load's shape over a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LiveShape {
    /// A constant rate.
    Steady,
    /// 30 s at twice the rate, then 30 s at a fifth of it, repeated: the
    /// mean is 1.1 × the rate (the simulator's `waves` made short enough
    /// that a run of a few minutes holds several).
    Waves,
}

impl LiveShape {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Steady => "steady",
            Self::Waves => "waves",
        }
    }

    /// By name.
    pub fn parse(name: &str) -> Option<Self> {
        [Self::Steady, Self::Waves]
            .into_iter()
            .find(|s| s.name() == name)
    }

    /// Requests per second at `t_s` for a mean `rate`.
    pub fn rate_at(self, rate: f64, t_s: f64) -> f64 {
        match self {
            Self::Steady => rate,
            Self::Waves if t_s % 60.0 < 30.0 => rate * 2.0,
            Self::Waves => rate * 0.2,
        }
    }
}

/// Arrival times in `[0, duration_s)` of a Poisson process of rate
/// `shape.rate_at(rate, t)`, by thinning; the same for the same seed, so
/// the baseline and every contender see the same requests.
pub fn arrivals(shape: LiveShape, rate: f64, duration_s: f64, seed: u64) -> Vec<f64> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let bound = rate * 2.0;
    let mut out = Vec::new();
    let mut t = 0.0;
    if bound <= 0.0 {
        return out;
    }
    loop {
        t += exp_sample(&mut rng, bound);
        if t >= duration_s {
            return out;
        }
        if rng.random::<f64>() < shape.rate_at(rate, t) / bound {
            out.push(t);
        }
    }
}

/// Words the test model's tokenizer (trained on Python's own sources) has
/// as single tokens with their leading space, so a prompt of `n` words is
/// about `n` tokens; the engine's count is recorded per request.
const WORDS: &[&str] = &[
    "def", "return", "self", "import", "class", "if", "else", "for", "in", "not", "None", "True",
    "False", "with", "as", "try", "except", "raise", "while", "and", "or", "is", "from", "lambda",
    "yield", "pass", "break", "continue", "value", "name", "result", "data", "list", "dict",
    "path", "file", "line", "text", "args", "key", "type", "object", "module", "error", "index",
];

/// A seeded prompt of `words` words.
pub fn prompt(seed: u64, words: usize) -> String {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let picked: Vec<&str> = (0..words)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    picked.join(" ")
}

/// OpenAI batch lines of `n` completions of `prompt_words` words and
/// exactly `output_tokens` tokens each (`ignore_eos`, a vLLM sampling
/// parameter: a random-weight model would otherwise stop anywhere).
pub fn batch_lines(
    model: &str,
    n: usize,
    prompt_words: usize,
    output_tokens: u32,
    seed: u64,
) -> String {
    let mut out = String::new();
    for i in 0..n {
        let body = json!({
            "model": model,
            "prompt": prompt(seed ^ (0xba7c_0000_0000 + i as u64), prompt_words),
            "max_tokens": output_tokens,
            "ignore_eos": true,
        });
        let line = json!({"custom_id": format!("b-{i}"), "method": "POST", "url": "/v1/completions", "body": body});
        out.push_str(&line.to_string());
        out.push('\n');
    }
    out
}

/// Sends one streamed interactive completion and times it at the client:
/// the first token, every later one, the usage the engine reports. Gives
/// up after `give_up` (then it is a failed request).
pub async fn interactive_request(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: &str,
    output_tokens: u32,
    run_start: Instant,
    give_up: Duration,
) -> Timing {
    let sent = Instant::now();
    let sent_s = (sent - run_start).as_secs_f64();
    let body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut timing = Timing {
        sent_s,
        ttft_s: None,
        itl_p95_s: None,
        itl_mean_s: None,
        last_token_s: None,
        output_tokens: 0,
        prompt_tokens: 0,
        ok: false,
    };
    let mut token_times = Vec::with_capacity(output_tokens as usize);
    // A busy API server sends several tokens in one event: the count is
    // the engine's own (`usage`), the times are the events'.
    let mut completion_tokens = None;
    let stream = async {
        let mut response = client
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .ok()?;
        if !response.status().is_success() {
            return None;
        }
        let mut pending = String::new();
        let mut done = false;
        while let Some(chunk) = response.chunk().await.ok()? {
            let now = (Instant::now() - sent).as_secs_f64();
            pending.push_str(&String::from_utf8_lossy(&chunk));
            // Server-sent events: one `data: {...}` per line.
            while let Some(end) = pending.find('\n') {
                let line: String = pending.drain(..=end).collect();
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(event) = serde_json::from_str::<serde_json::Value>(data) else {
                    continue;
                };
                if let Some(usage) = event.get("usage").filter(|u| u.is_object()) {
                    timing.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                    completion_tokens = usage["completion_tokens"].as_u64();
                }
                let texts = event["choices"].as_array().map_or(0, Vec::len);
                if texts > 0 {
                    token_times.push(now);
                }
            }
        }
        Some(done)
    };
    let done = tokio::time::timeout(give_up, stream).await.ok().flatten();
    timing.ttft_s = token_times.first().copied();
    timing.itl_p95_s = itl_p95(&token_times);
    timing.last_token_s = token_times.last().copied();
    timing.output_tokens = completion_tokens.unwrap_or(token_times.len() as u64);
    if let [first, .., last] = token_times[..] {
        timing.itl_mean_s = Some((last - first) / (timing.output_tokens.max(2) - 1) as f64);
    }
    timing.ok = done == Some(true) && timing.output_tokens >= u64::from(output_tokens);
    timing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_and_follow_the_rate() {
        let a = arrivals(LiveShape::Steady, 3.0, 1000.0, 7);
        assert_eq!(a, arrivals(LiveShape::Steady, 3.0, 1000.0, 7));
        assert_ne!(a, arrivals(LiveShape::Steady, 3.0, 1000.0, 8));
        let n = a.len() as f64;
        assert!((2700.0..3300.0).contains(&n), "{n}");
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn waves_alternate_high_and_low() {
        let a = arrivals(LiveShape::Waves, 3.0, 1200.0, 1);
        let high = a.iter().filter(|t| *t % 60.0 < 30.0).count() as f64;
        let low = a.len() as f64 - high;
        // 6/s for 600 s against 0.6/s for 600 s.
        assert!((3300.0..3900.0).contains(&high), "{high}");
        assert!((250.0..480.0).contains(&low), "{low}");
        assert_eq!(LiveShape::parse("waves"), Some(LiveShape::Waves));
        assert_eq!(LiveShape::parse("diurnal"), None);
    }

    #[tokio::test]
    async fn tokens_merged_into_one_event_are_counted_from_usage() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A busy vLLM API server sends several tokens in one event; the
        // request is complete when the engine's usage says so (found by the
        // real-engine suite under load: 4 of 20 requests counted short).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !(request.windows(4).any(|w| w == b"\r\n\r\n") && request.ends_with(b"}")) {
                let n = socket.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request ended early");
                request.extend_from_slice(&buf[..n]);
            }
            let events = concat!(
                "data: {\"choices\":[{\"text\":\" a\"}]}\n\n",
                "data: {\"choices\":[{\"text\":\" b c d\"}]}\n\n",
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":4}}\n\n",
                "data: [DONE]\n\n"
            );
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{events}",
                events.len()
            );
            socket.write_all(response.as_bytes()).await.unwrap();
        });
        let client = reqwest::Client::new();
        let t = interactive_request(
            &client,
            &url,
            "m",
            "p",
            4,
            Instant::now(),
            Duration::from_secs(10),
        )
        .await;
        assert!(t.ok, "{t:?}");
        assert_eq!((t.output_tokens, t.prompt_tokens), (4, 5), "{t:?}");
        assert!(t.itl_mean_s.is_some() && t.ttft_s.is_some(), "{t:?}");
    }

    #[test]
    fn prompts_and_batch_lines_are_seeded() {
        assert_eq!(prompt(3, 10), prompt(3, 10));
        assert_eq!(prompt(3, 10).split(' ').count(), 10);
        let lines = batch_lines("m", 3, 5, 64, 1);
        let parsed: Vec<serde_json::Value> = lines
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON"))
            .collect();
        assert_eq!(parsed.len(), 3);
        assert_eq!(parsed[2]["custom_id"], "b-2");
        assert_eq!(parsed[0]["body"]["max_tokens"], 64);
        assert_ne!(parsed[0]["body"]["prompt"], parsed[1]["body"]["prompt"]);
    }
}
