//! The Debian `prometheus` binary with a generated config that scrapes the
//! given targets (every second by default), with its TSDB in a scratch
//! directory; stopped by PID (on drop too).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{ScratchDir, free_port};

/// What to scrape.
#[derive(Debug, Clone, Default)]
pub struct PrometheusSpec {
    /// `host:port` targets (path `/metrics`).
    pub targets: Vec<String>,
    /// Metric-name regexes dropped at scrape time (`metric_relabel_configs`),
    /// to simulate an endpoint picker that does not export them.
    pub drop_metrics: Vec<String>,
}

/// A recording rule: `record` is `expr`, with `labels` added.
#[derive(Debug, Clone)]
pub struct RecordingRule {
    /// The recorded metric's name.
    pub record: String,
    /// PromQL (single quotes are not allowed: the YAML quotes it with them).
    pub expr: String,
    /// Labels added to the recorded series.
    pub labels: Vec<(String, String)>,
}

/// A running Prometheus.
#[derive(Debug)]
pub struct Prometheus {
    child: Option<Child>,
    port: u16,
    dir: ScratchDir,
}

impl Prometheus {
    /// Writes the config and starts Prometheus scraping every `interval`,
    /// with `labels` added to every scraped series (the target's labels,
    /// as service discovery adds a pool label) and recording `rules`
    /// evaluated every second; returns once it is ready.
    pub async fn start(
        spec: &PrometheusSpec,
        interval: Duration,
        labels: &[(&str, &str)],
        rules: &[RecordingRule],
    ) -> Result<Self, String> {
        let dir = ScratchDir::new("prometheus")?;
        let write = |name: &str, text: String| {
            std::fs::write(dir.path().join(name), text).map_err(|e| format!("write {name}: {e}"))
        };
        if !rules.is_empty() {
            write("rules.yml", rules_yaml(rules))?;
        }
        write("prometheus.yml", config_yaml(spec, interval, labels, rules))?;
        let mut p = Self {
            child: None,
            port: free_port()?,
            dir,
        };
        p.spawn().await?;
        Ok(p)
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                self.dir.path().join("prometheus.yml").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{}", self.port))
            .arg(format!(
                "--storage.tsdb.path={}",
                self.dir.path().join("data").display()
            ))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("spawn prometheus (Debian package `prometheus`; scripts/test.sh installs it): {e}")
            })?;
        self.child = Some(child);
        let ready = format!("{}/-/ready", self.url());
        let client = reqwest::Client::new();
        for _ in 0..300 {
            if let Ok(r) = client.get(&ready).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!("prometheus did not become ready at {ready}"))
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The PID of the running process.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the process by PID (SIGTERM, SIGKILL after 5 s) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = super::signal("TERM", &child.id().to_string());
            for _ in 0..100 {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data directory.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.spawn().await
    }

    /// Runs an instant query; the vector's values (empty on no sample or
    /// any error).
    pub async fn query(&self, query: &str) -> Vec<f64> {
        let r = reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.url()))
            .query(&[("query", query)])
            .send()
            .await;
        let Ok(r) = r else { return Vec::new() };
        let Ok(v) = r.json::<serde_json::Value>().await else {
            return Vec::new();
        };
        v["data"]["result"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["value"][1].as_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits (up to `limit`) until `query` returns at least one sample.
    pub async fn wait_for_sample(&self, query: &str, limit: Duration) -> Result<(), String> {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if !self.query(query).await.is_empty() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(format!("no sample of {query} within {limit:?}"))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `rules.yml`: one group evaluated every second.
fn rules_yaml(rules: &[RecordingRule]) -> String {
    let mut text = String::from("groups:\n  - name: test\n    interval: 1s\n    rules:\n");
    for rule in rules {
        text.push_str(&format!(
            "      - record: {}\n        expr: '{}'\n",
            rule.record, rule.expr
        ));
        if !rule.labels.is_empty() {
            text.push_str("        labels:\n");
            for (k, v) in &rule.labels {
                text.push_str(&format!("          {k}: '{v}'\n"));
            }
        }
    }
    text
}

/// `prometheus.yml`: one job, `pool`, over the static targets.
fn config_yaml(
    spec: &PrometheusSpec,
    interval: Duration,
    labels: &[(&str, &str)],
    rules: &[RecordingRule],
) -> String {
    let targets: Vec<String> = spec.targets.iter().map(|t| format!("'{t}'")).collect();
    let interval_ms = interval.as_millis();
    // A scrape must end before the next one starts; 900 ms is enough for
    // any local target.
    let timeout_ms = (interval_ms * 9 / 10).min(900);
    let mut config =
        format!("global:\n  scrape_interval: {interval_ms}ms\n  evaluation_interval: 1s\n");
    if !rules.is_empty() {
        config.push_str("rule_files: ['rules.yml']\n");
    }
    config.push_str(&format!(
        "scrape_configs:\n  - job_name: pool\n    scrape_interval: {interval_ms}ms\n    scrape_timeout: {timeout_ms}ms\n\
         \x20   static_configs:\n      - targets: [{}]\n",
        targets.join(", ")
    ));
    if !labels.is_empty() {
        config.push_str("        labels:\n");
        for (k, v) in labels {
            config.push_str(&format!("          {k}: '{v}'\n"));
        }
    }
    if !spec.drop_metrics.is_empty() {
        config.push_str("    metric_relabel_configs:\n");
        for regex in &spec.drop_metrics {
            config.push_str(&format!(
                "      - source_labels: [__name__]\n        regex: '{regex}'\n        action: drop\n"
            ));
        }
    }
    config
}
