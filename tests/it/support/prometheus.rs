//! Spawns the Debian `prometheus` binary with a generated config that
//! scrapes the given targets every second, on a free loopback port, with
//! its TSDB in a temp dir; stops it by PID (on drop too).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{TempDir, free_port};

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
    dir: TempDir,
}

impl Prometheus {
    /// Writes the config and starts Prometheus scraping every second;
    /// returns once it is ready.
    pub async fn start(spec: &PrometheusSpec) -> Self {
        Self::start_scraping_every(spec, Duration::from_secs(1)).await
    }

    /// Like [`Self::start`] with another scrape interval: real deployments
    /// scrape every 15 to 60 s, which is what the lag tests reproduce.
    pub async fn start_scraping_every(spec: &PrometheusSpec, interval: Duration) -> Self {
        Self::start_with(spec, interval, &[], &[]).await
    }

    /// Like [`Self::start`], with `labels` added to every scraped series
    /// (the target's labels, as service discovery adds a pool label) and
    /// recording `rules` evaluated every second (e.g. a ready-endpoint count
    /// where no endpoint picker exports one).
    pub async fn start_labelled(
        spec: &PrometheusSpec,
        labels: &[(&str, &str)],
        rules: &[RecordingRule],
    ) -> Self {
        Self::start_with(spec, Duration::from_secs(1), labels, rules).await
    }

    async fn start_with(
        spec: &PrometheusSpec,
        interval: Duration,
        labels: &[(&str, &str)],
        rules: &[RecordingRule],
    ) -> Self {
        let dir = TempDir::new("prometheus");
        let targets: Vec<String> = spec.targets.iter().map(|t| format!("'{t}'")).collect();
        let interval_ms = interval.as_millis();
        let mut config =
            format!("global:\n  scrape_interval: {interval_ms}ms\n  evaluation_interval: 1s\n");
        if !rules.is_empty() {
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
            std::fs::write(dir.0.join("rules.yml"), text).expect("write rules.yml");
            config.push_str("rule_files: ['rules.yml']\n");
        }
        config.push_str(&format!(
            "scrape_configs:\n  - job_name: pool\n    scrape_interval: {interval_ms}ms\n    scrape_timeout: 900ms\n\
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
        std::fs::write(dir.0.join("prometheus.yml"), config).expect("write prometheus.yml");
        let mut p = Self {
            child: None,
            port: free_port(),
            dir,
        };
        p.spawn().await;
        p
    }

    async fn spawn(&mut self) {
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                self.dir.0.join("prometheus.yml").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{}", self.port))
            .arg(format!(
                "--storage.tsdb.path={}",
                self.dir.0.join("data").display()
            ))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn prometheus (Debian package `prometheus`; scripts/test.sh installs it)");
        self.child = Some(child);
        let ready = format!("{}/-/ready", self.url());
        let client = reqwest::Client::new();
        for _ in 0..300 {
            if let Ok(r) = client.get(&ready).send().await
                && r.status().is_success()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("prometheus did not become ready at {ready}");
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The PID of the running process.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the process by PID and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
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
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn().await;
    }

    /// Runs an instant query; the vector's values (empty on no sample).
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
    pub async fn wait_for_sample(&self, query: &str, limit: Duration) {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if !self.query(query).await.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("no sample of {query} within {limit:?}");
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}
