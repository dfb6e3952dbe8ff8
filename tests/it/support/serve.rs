//! `sluicegate serve` in process for the Batch API suites: the config
//! for a gateway (our simulator) and a transport, a plain HTTP client for
//! the OpenAI endpoints (multipart built by hand: no second HTTP stack).

use std::time::Duration;

use serde_json::Value;
use sluicegate::config::{Config, ServeConfig};
use sluicegate::serve::Server;

use super::{TempDir, free_port};

/// What to start.
#[derive(Debug, Clone)]
pub struct ServeSpec {
    /// Gateway base URL (the simulator).
    pub gateway_url: String,
    /// A gate that stays closed (an endpoint-scrape gate on a dead port:
    /// unreadable metrics mean zero budget), so requests wait.
    pub closed_gate: bool,
    /// `serve.api_keys`, `tenant:key` entries.
    pub keys: Option<String>,
    /// Redis transport on this port; embedded when `None`.
    pub redis_port: Option<u16>,
    /// `serve.dispatcher = separate` when false.
    pub in_process: bool,
    /// Size limits (`serve.max_*`), defaults when `None`.
    pub max_file_bytes: Option<u64>,
    /// `serve.max_line_bytes`.
    pub max_line_bytes: Option<u64>,
    /// `serve.max_lines_per_batch`.
    pub max_lines: Option<u64>,
    /// `serve.file_retention`, the default when `None`.
    pub file_retention: Option<Duration>,
    /// `serve.tenant_limits`, none when `None`.
    pub tenant_limits: Option<sluicegate::serve::quota::TenantLimits>,
    /// More `[dispatch]` lines (e.g. `tenant_weights`).
    pub dispatch: String,
    /// The queue's `max_sys` (the window).
    pub max_sys: u32,
    /// `serve.pass_headers`.
    pub pass_headers: Vec<String>,
    /// An endpoint-scrape gate reading metric `m` (4 per pod) at this
    /// `/metrics` URL (a test opens and closes it); wins over
    /// `closed_gate`.
    pub gate_url: Option<String>,
    /// `serve.flex_max_wait`.
    pub flex_max_wait: Option<Duration>,
    /// `serve.flex_max_held`.
    pub flex_max_held: Option<u64>,
    /// `serve.flex_max_held_per_tenant`.
    pub flex_max_held_per_tenant: Option<u64>,
    /// `serve.background_max_per_tenant`.
    pub background_max_per_tenant: Option<u64>,
    /// `serve.passthrough`.
    pub passthrough: bool,
    /// `serve.endpoints`, the default when `None`.
    pub endpoints: Option<Vec<String>>,
}

impl ServeSpec {
    /// Embedded, open gate, no keys, dispatcher in process.
    pub fn new(gateway_url: &str) -> Self {
        Self {
            gateway_url: gateway_url.to_owned(),
            closed_gate: false,
            keys: None,
            redis_port: None,
            in_process: true,
            max_file_bytes: None,
            max_line_bytes: None,
            max_lines: None,
            file_retention: None,
            tenant_limits: None,
            dispatch: String::new(),
            max_sys: 8,
            pass_headers: Vec::new(),
            gate_url: None,
            flex_max_wait: None,
            flex_max_held: None,
            flex_max_held_per_tenant: None,
            background_max_per_tenant: None,
            passthrough: false,
            endpoints: None,
        }
    }
}

/// A running server and the directories it owns.
#[derive(Debug)]
pub struct Served {
    /// The server.
    pub server: Server,
    /// `http://addr`.
    pub base: String,
    /// Holds the embedded queue file (and, unless shared, the data dir).
    pub dir: TempDir,
}

impl Served {
    /// Stops and waits.
    pub async fn stop(self) {
        self.server.shutdown();
        self.server.wait().await.expect("the server stops cleanly");
    }
}

/// The dispatcher config of `spec`, its embedded queue in `dir`.
pub fn config(spec: &ServeSpec, dir: &std::path::Path) -> Config {
    let transport = match spec.redis_port {
        Some(port) => {
            format!("transport = \"redis\"\n[redis]\nurl = \"redis://127.0.0.1:{port}/0\"\n")
        }
        None => format!(
            "transport = \"embedded\"\n[embedded]\npath = \"{}\"\n",
            dir.join("queue.db").display()
        ),
    };
    let gate = match (&spec.gate_url, spec.closed_gate) {
        (Some(url), _) => format!(
            "gate_type = \"endpoint-scrape\"\n[queue.gate_params]\nurl = \"{url}\"\nmetric = \"m\"\nmax_count_per_pod = 4\n"
        ),
        (None, true) => format!(
            "gate_type = \"endpoint-scrape\"\n[queue.gate_params]\nurl = \"http://127.0.0.1:{}/metrics\"\nmetric = \"m\"\nmax_count_per_pod = 4\n",
            free_port()
        ),
        (None, false) => "gate_type = \"constant\"\n".to_owned(),
    };
    let text = format!(
        "{transport}[gateway]\nurl = \"{}\"\n[dispatch]\npoll_interval = \"100ms\"\nreceive_wait = \"100ms\"\nmax_staleness = \"1s\"\n{}\n[telemetry]\nlisten = \"127.0.0.1:0\"\n[[queue]]\nqueue_name = \"batch-api\"\nmax_sys = {}\n{gate}",
        spec.gateway_url, spec.dispatch, spec.max_sys
    );
    Config::from_toml_str(&text, &Default::default()).expect("test config loads")
}

/// Starts a server for `spec`; `data_dir` shares file bodies between
/// servers (Redis replicas), else it lives in the server's directory.
pub async fn start(spec: &ServeSpec, data_dir: Option<&std::path::Path>) -> Served {
    let dir = TempDir::new("serve");
    let data_dir = data_dir.map_or_else(|| dir.0.join("data"), std::path::Path::to_path_buf);
    let server = start_in(spec, &dir.0, &data_dir).await;
    let base = format!("http://{}", server.addr);
    Served { server, base, dir }
}

/// Starts a server for `spec` on the queue in `dir` and the bodies in
/// `data_dir` (a restart reuses both).
pub async fn start_in(
    spec: &ServeSpec,
    dir: &std::path::Path,
    data_dir: &std::path::Path,
) -> Server {
    let config = config(spec, dir);
    let mut serve = ServeConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data_dir.to_path_buf(),
        api_keys: spec.keys.clone().map(sluicegate::config::Secret::new),
        pass_headers: spec.pass_headers.clone(),
        ..ServeConfig::default()
    };
    if !spec.in_process {
        serve.dispatcher = sluicegate::config::ServeDispatcher::Separate;
    }
    if let Some(n) = spec.max_file_bytes {
        serve.max_file_bytes = n;
    }
    if let Some(n) = spec.max_line_bytes {
        serve.max_line_bytes = n;
    }
    if let Some(n) = spec.max_lines {
        serve.max_lines_per_batch = n;
    }
    if let Some(d) = spec.file_retention {
        serve.file_retention = d;
    }
    if let Some(limits) = &spec.tenant_limits {
        serve.tenant_limits = limits.clone();
    }
    if let Some(d) = spec.flex_max_wait {
        serve.flex_max_wait = d;
    }
    if let Some(n) = spec.flex_max_held {
        serve.flex_max_held = n;
    }
    if let Some(n) = spec.flex_max_held_per_tenant {
        serve.flex_max_held_per_tenant = n;
    }
    if let Some(n) = spec.background_max_per_tenant {
        serve.background_max_per_tenant = n;
    }
    serve.passthrough = spec.passthrough;
    if let Some(endpoints) = &spec.endpoints {
        serve.endpoints.clone_from(endpoints);
    }
    sluicegate::serve::start(&config, &serve, std::future::pending())
        .await
        .expect("the server starts")
}

/// Moves the stored batch `id`'s deadline to now, as if its completion
/// window (at least a minute) had passed: the embedded store in
/// `data_dir`, written as another server would (compare-and-set).
pub async fn expire_now(data_dir: &std::path::Path, id: &str) {
    use sluicegate::serve::store::{SqliteStore, Store};
    let store = Store::Sqlite(SqliteStore::open(&data_dir.join("batches.db")).expect("store"));
    loop {
        let old = store.batch(id).await.expect("read").expect("batch exists");
        let mut new = old.clone();
        new.expires_at = old.created_at;
        if store.replace_batch(&old, &new).await.expect("write") {
            return;
        }
    }
}

/// The stored record of batch `id` in the embedded store in `data_dir`
/// (fields the API does not show, such as `stop`).
pub async fn stored(data_dir: &std::path::Path, id: &str) -> sluicegate::serve::model::BatchRecord {
    use sluicegate::serve::store::{SqliteStore, Store};
    let store = Store::Sqlite(SqliteStore::open(&data_dir.join("batches.db")).expect("store"));
    store.batch(id).await.expect("read").expect("batch exists")
}

/// A gateway that holds every request until released: requests in
/// flight for as long as a test needs.
#[derive(Debug)]
pub struct HeldGateway {
    /// `http://addr`.
    pub url: String,
    /// One item per request received.
    pub arrived: tokio::sync::mpsc::Receiver<()>,
    /// Releases every held request (and later ones at once).
    pub release: std::sync::Arc<tokio::sync::Notify>,
    released: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// One item per held request whose client closed the connection
    /// before it was answered (an abort).
    pub aborted: tokio::sync::mpsc::Receiver<()>,
}

impl HeldGateway {
    /// Listens on a free loopback port.
    pub async fn start() -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (tx, arrived) = tokio::sync::mpsc::channel(64);
        let (abort_tx, aborted) = tokio::sync::mpsc::channel(64);
        let release = std::sync::Arc::new(tokio::sync::Notify::new());
        let released = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, done) = (release.clone(), released.clone());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (tx, r, done) = (tx.clone(), r.clone(), done.clone());
                let abort_tx = abort_tx.clone();
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    // Headers, then the body its length names.
                    loop {
                        let Ok(n) = socket.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        seen.extend_from_slice(&buf[..n]);
                        let text = String::from_utf8_lossy(&seen).to_string();
                        if let Some(end) = text.find("\r\n\r\n") {
                            let length = text[..end]
                                .lines()
                                .find_map(|l| {
                                    let (k, v) = l.split_once(':')?;
                                    k.eq_ignore_ascii_case("content-length")
                                        .then(|| v.trim().parse::<usize>().ok())?
                                })
                                .unwrap_or(0);
                            if seen.len() >= end + 4 + length {
                                break;
                            }
                        }
                    }
                    let _ = tx.send(()).await;
                    let notified = r.notified();
                    if !done.load(std::sync::atomic::Ordering::SeqCst) {
                        // Held: until released, or until the client closes
                        // the connection (a read of 0 bytes or an error).
                        tokio::select! {
                            () = notified => {}
                            _ = socket.read(&mut buf) => {
                                let _ = abort_tx.send(()).await;
                                return;
                            }
                        }
                    }
                    let body = r#"{"id":"cmpl-held","object":"text_completion","model":"sim-model","choices":[{"index":0,"text":"held answer","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#;
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(response.as_bytes()).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        Self {
            url,
            arrived,
            release,
            released,
            aborted,
        }
    }

    /// Answers every held request, and every later one at once.
    pub fn release_all(&self) {
        self.released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.release.notify_waiters();
    }
}

/// A plain client of the OpenAI endpoints.
#[derive(Debug, Clone)]
pub struct Api {
    /// `http://addr`.
    pub base: String,
    /// Bearer key, if any.
    pub key: Option<String>,
    client: reqwest::Client,
}

impl Api {
    /// A client of `base` with `key`.
    pub fn new(base: &str, key: Option<&str>) -> Self {
        Self {
            base: base.to_owned(),
            key: key.map(str::to_owned),
            client: reqwest::Client::new(),
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.client.request(method, format!("{}{path}", self.base));
        match &self.key {
            Some(k) => r.header("authorization", format!("Bearer {k}")),
            None => r,
        }
    }

    /// Status and JSON body of a request.
    async fn send(r: reqwest::RequestBuilder) -> (u16, Value) {
        let response = r.send().await.expect("request answered");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// `POST /v1/files` with `purpose` and a file of `bytes`.
    pub async fn upload(&self, purpose: &str, bytes: &[u8]) -> (u16, Value) {
        self.upload_with(purpose, bytes, &[]).await
    }

    /// [`Api::upload`] with more form fields before the file, e.g.
    /// `("expires_after[seconds]", "3600")`.
    pub async fn upload_with(
        &self,
        purpose: &str,
        bytes: &[u8],
        fields: &[(&str, &str)],
    ) -> (u16, Value) {
        let boundary = "sluicegate-test-boundary";
        let mut body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
        );
        for (name, value) in fields {
            body.push_str(&format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            ));
        }
        let mut body = format!(
            "{body}--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"input.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(bytes);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let r = self
            .request(reqwest::Method::POST, "/v1/files")
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(body);
        Self::send(r).await
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> (u16, Value) {
        Self::send(self.request(reqwest::Method::GET, path)).await
    }

    /// `DELETE path`.
    pub async fn delete(&self, path: &str) -> (u16, Value) {
        Self::send(self.request(reqwest::Method::DELETE, path)).await
    }

    /// `GET path` as text (file content).
    pub async fn text(&self, path: &str) -> (u16, String) {
        let response = self
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .expect("request answered");
        let status = response.status().as_u16();
        (status, response.text().await.expect("body"))
    }

    /// `POST path` with a JSON body and extra headers.
    pub async fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut r = self
            .request(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body.to_string());
        for (name, value) in headers {
            r = r.header(*name, *value);
        }
        Self::send(r).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .request(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body.to_string());
        Self::send(r).await
    }

    /// Uploads `lines` and asks for a batch on `/v1/completions`: the
    /// status and body of the creation (which may be refused).
    pub async fn try_batch(&self, lines: &str) -> (u16, Value) {
        let (status, file) = self.upload("batch", lines.as_bytes()).await;
        assert_eq!(status, 200, "upload: {file}");
        self.post(
            "/v1/batches",
            &serde_json::json!({
                "input_file_id": file["id"], "endpoint": "/v1/completions",
                "completion_window": "24h",
            }),
        )
        .await
    }

    /// Uploads `lines` and creates a batch on `endpoint` with `window`.
    pub async fn batch(&self, lines: &str, endpoint: &str, window: &str) -> Value {
        let metadata = serde_json::json!({"run": "test"});
        self.batch_with(lines, endpoint, window, &metadata).await
    }

    /// [`Api::batch`] with its `metadata`.
    pub async fn batch_with(
        &self,
        lines: &str,
        endpoint: &str,
        window: &str,
        metadata: &Value,
    ) -> Value {
        let (status, file) = self.upload("batch", lines.as_bytes()).await;
        assert_eq!(status, 200, "upload: {file}");
        let (status, batch) = self
            .post(
                "/v1/batches",
                &serde_json::json!({
                    "input_file_id": file["id"], "endpoint": endpoint,
                    "completion_window": window, "metadata": metadata,
                }),
            )
            .await;
        assert_eq!(status, 200, "create: {batch}");
        batch
    }

    /// Polls the batch until `done` holds (at most `within`).
    pub async fn wait_for(
        &self,
        id: &str,
        within: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let give_up = std::time::Instant::now() + within;
        loop {
            let (status, batch) = self.get(&format!("/v1/batches/{id}")).await;
            assert_eq!(status, 200, "{batch}");
            if done(&batch) {
                return batch;
            }
            assert!(
                std::time::Instant::now() < give_up,
                "batch never reached the state: {batch}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `n` completion lines with ids `r0…`, `max_tokens` each.
pub fn completion_lines(n: usize, max_tokens: u32) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"custom_id\":\"r{i}\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{{\"model\":\"sim-model\",\"prompt\":\"hello {i}\",\"max_tokens\":{max_tokens}}}}}\n"
            )
        })
        .collect()
}

/// Whether the batch is in a terminal status.
pub fn terminal(batch: &Value) -> bool {
    matches!(
        batch["status"].as_str(),
        Some("completed" | "failed" | "expired" | "cancelled")
    )
}
