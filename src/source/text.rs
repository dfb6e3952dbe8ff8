//! Our own parser of the Prometheus text exposition format (0.0.4, plus the
//! `# EOF` line of OpenMetrics). Existing parser crates drop metric names
//! that contain `:`, which is every `vllm:` metric; this one keeps them.
//!
//! The parser is strict: a line it cannot read is an error for the whole
//! scrape (a gate reading half a page could read an idle pool), and no
//! input, however malformed, makes it panic (property and fuzz-style tests
//! below).

use std::collections::BTreeMap;
use std::fmt;

/// The declared type of a metric family (`# TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    /// Monotonic counter.
    Counter,
    /// Gauge.
    Gauge,
    /// Histogram (`_bucket`, `_sum`, `_count` samples).
    Histogram,
    /// Summary (quantile samples, `_sum`, `_count`).
    Summary,
    /// Info metric (OpenMetrics).
    Info,
    /// State set (OpenMetrics).
    StateSet,
    /// Gauge histogram (OpenMetrics).
    GaugeHistogram,
    /// No `# TYPE` line, or declared `untyped`/`unknown`.
    Untyped,
}

impl MetricType {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "counter" => Self::Counter,
            "gauge" => Self::Gauge,
            "histogram" => Self::Histogram,
            "summary" => Self::Summary,
            "info" => Self::Info,
            "stateset" => Self::StateSet,
            "gaugehistogram" => Self::GaugeHistogram,
            "untyped" | "unknown" => Self::Untyped,
            _ => return None,
        })
    }

    /// Suffixes a sample of this family may carry after the family name.
    fn suffixes(self) -> &'static [&'static str] {
        match self {
            Self::Counter => &["_total", "_created"],
            Self::Histogram | Self::GaugeHistogram => {
                &["_bucket", "_sum", "_count", "_created", "_gcount", "_gsum"]
            }
            Self::Summary => &["_sum", "_count", "_created"],
            Self::Info => &["_info"],
            _ => &[],
        }
    }
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The sample's full name (for histograms including `_bucket` etc.).
    pub name: String,
    /// Labels, unescaped.
    pub labels: BTreeMap<String, String>,
    /// The value (may be NaN or infinite, as written).
    pub value: f64,
    /// Optional timestamp in milliseconds since the Unix epoch.
    pub timestamp_ms: Option<i64>,
}

impl Sample {
    /// Whether every `(name, value)` in `matchers` is a label of this sample.
    pub fn matches(&self, matchers: &BTreeMap<String, String>) -> bool {
        matchers
            .iter()
            .all(|(k, v)| self.labels.get(k).is_some_and(|have| have == v))
    }
}

/// Metadata of a family declared by `# TYPE` / `# HELP`.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyMeta {
    /// Declared type.
    pub kind: MetricType,
    /// Help text, unescaped.
    pub help: Option<String>,
}

/// One histogram series: the buckets of one label set.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSeries {
    /// Labels other than `le`.
    pub labels: BTreeMap<String, String>,
    /// `(upper bound, cumulative count)`, sorted by bound.
    pub buckets: Vec<(f64, f64)>,
    /// `_sum`, when present.
    pub sum: Option<f64>,
    /// `_count`, when present.
    pub count: Option<f64>,
}

/// A parsed `/metrics` page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    /// Every sample, in page order.
    pub samples: Vec<Sample>,
    /// Declared families by family name.
    pub families: BTreeMap<String, FamilyMeta>,
}

impl Exposition {
    /// The samples whose full name is `name`.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The type of the family a sample name belongs to (by `# TYPE`).
    pub fn type_of(&self, sample_name: &str) -> MetricType {
        if let Some(meta) = self.families.get(sample_name) {
            return meta.kind;
        }
        for (family, meta) in &self.families {
            if let Some(rest) = sample_name.strip_prefix(family.as_str())
                && meta.kind.suffixes().contains(&rest)
            {
                return meta.kind;
            }
        }
        MetricType::Untyped
    }

    /// The series of histogram `family` (`<family>_bucket`, `_sum`, `_count`).
    pub fn histogram(&self, family: &str) -> Vec<HistogramSeries> {
        let bucket = format!("{family}_bucket");
        let sum = format!("{family}_sum");
        let count = format!("{family}_count");
        let mut series: Vec<HistogramSeries> = Vec::new();
        let mut slot = |labels: BTreeMap<String, String>| -> usize {
            match series.iter().position(|s| s.labels == labels) {
                Some(i) => i,
                None => {
                    series.push(HistogramSeries {
                        labels,
                        buckets: Vec::new(),
                        sum: None,
                        count: None,
                    });
                    series.len() - 1
                }
            }
        };
        let mut rows = Vec::new();
        for s in &self.samples {
            if s.name == bucket {
                let mut labels = s.labels.clone();
                let Some(le) = labels.remove("le").and_then(|v| parse_value(&v)) else {
                    continue;
                };
                rows.push((slot(labels), Some(le), s.value, 0));
            } else if s.name == sum {
                rows.push((slot(s.labels.clone()), None, s.value, 1));
            } else if s.name == count {
                rows.push((slot(s.labels.clone()), None, s.value, 2));
            }
        }
        for (i, le, value, what) in rows {
            match (what, le) {
                (0, Some(le)) => series[i].buckets.push((le, value)),
                (1, _) => series[i].sum = Some(value),
                _ => series[i].count = Some(value),
            }
        }
        for s in &mut series {
            s.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        series
    }
}

/// Why a page could not be parsed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// Parses a text-format page.
pub fn parse(text: &str) -> Result<Exposition, ParseError> {
    let mut out = Exposition::default();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let err = |message: String| ParseError { line, message };
        let trimmed = raw.trim_matches(|c| c == ' ' || c == '\t' || c == '\r');
        if trimmed.is_empty() {
            continue;
        }
        if let Some(comment) = trimmed.strip_prefix('#') {
            parse_comment(comment, &mut out).map_err(err)?;
            continue;
        }
        out.samples.push(parse_sample(trimmed).map_err(err)?);
    }
    Ok(out)
}

fn parse_comment(comment: &str, out: &mut Exposition) -> Result<(), String> {
    let comment = comment.trim_start_matches([' ', '\t']);
    let (keyword, rest) = split_word(comment);
    match keyword {
        "HELP" | "TYPE" => {
            let (name, rest) = split_word(rest);
            if !is_metric_name(name) {
                return Err(format!("invalid metric name {name:?} in # {keyword}"));
            }
            let entry = out
                .families
                .entry(name.to_owned())
                .or_insert_with(|| FamilyMeta {
                    kind: MetricType::Untyped,
                    help: None,
                });
            if keyword == "TYPE" {
                let ty = rest.trim();
                entry.kind = MetricType::parse(ty)
                    .ok_or_else(|| format!("unknown metric type {ty:?} for {name}"))?;
            } else {
                entry.help = Some(unescape(rest, false)?);
            }
            Ok(())
        }
        // `# EOF` (OpenMetrics) and free comments.
        _ => Ok(()),
    }
}

/// Splits off the first space-separated word.
fn split_word(s: &str) -> (&str, &str) {
    let s = s.trim_start_matches([' ', '\t']);
    match s.find([' ', '\t']) {
        Some(i) => (&s[..i], &s[i + 1..]),
        None => (s, ""),
    }
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if !is_metric_name(name) {
        return Err(format!("invalid metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.trim_start_matches([' ', '\t']).strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
    let value = fields
        .next()
        .ok_or_else(|| format!("{name}: missing value"))?;
    let value = parse_value(value).ok_or_else(|| format!("{name}: invalid value {value:?}"))?;
    let timestamp_ms = match fields.next() {
        None => None,
        Some(t) => Some(
            t.parse::<i64>()
                .map_err(|_| format!("{name}: invalid timestamp {t:?}"))?,
        ),
    };
    if let Some(extra) = fields.next() {
        return Err(format!("{name}: unexpected {extra:?} after the value"));
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
        timestamp_ms,
    })
}

/// Parses `name="value",...}` and returns what follows the closing brace.
fn parse_labels<'a>(
    mut s: &'a str,
    labels: &mut BTreeMap<String, String>,
) -> Result<&'a str, String> {
    loop {
        s = s.trim_start_matches([' ', '\t']);
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest);
        }
        let eq = s
            .find('=')
            .ok_or_else(|| "label without '=' or unclosed '{'".to_owned())?;
        let label = s[..eq].trim_matches([' ', '\t']);
        if !is_label_name(label) {
            return Err(format!("invalid label name {label:?}"));
        }
        s = s[eq + 1..].trim_start_matches([' ', '\t']);
        s = s
            .strip_prefix('"')
            .ok_or_else(|| format!("label {label}: value must be quoted"))?;
        let (value, rest) =
            take_quoted(s).ok_or_else(|| format!("label {label}: unclosed quote"))?;
        if labels
            .insert(label.to_owned(), unescape(value, true)?)
            .is_some()
        {
            return Err(format!("duplicate label {label}"));
        }
        s = rest.trim_start_matches([' ', '\t']);
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err(format!("expected ',' or '}}' after label {label}"));
        }
    }
}

/// Splits at the closing unescaped quote: `(inside, after)`.
fn take_quoted(s: &str) -> Option<(&str, &str)> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some((&s[..i], &s[i + 1..])),
            _ => {}
        }
    }
    None
}

/// Unescapes `\\`, `\n` and (in label values) `\"`.
fn unescape(s: &str, quotes: bool) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('\\') => out.push('\\'),
            Some('n') => out.push('\n'),
            Some('"') if quotes => out.push('"'),
            // HELP text keeps unknown escapes as written.
            Some(other) if !quotes => {
                out.push('\\');
                out.push(other);
            }
            Some(other) => return Err(format!("invalid escape \\{other}")),
            None if !quotes => out.push('\\'),
            None => return Err("dangling backslash".to_owned()),
        }
    }
    Ok(out)
}

/// Parses a sample value: a float, `+Inf`, `-Inf`, `NaN`.
pub fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" | "+inf" | "inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        _ => {
            // Rust accepts "infinity" and "nan" spellings we do not want.
            if s.is_empty()
                || !s
                    .bytes()
                    .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
            {
                return None;
            }
            s.parse::<f64>().ok()
        }
    }
}

impl fmt::Display for MetricType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
            Self::Summary => "summary",
            Self::Info => "info",
            Self::StateSet => "stateset",
            Self::GaugeHistogram => "gaugehistogram",
            Self::Untyped => "untyped",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.125
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000",prefix_caching_hash_algo="builtin"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.75
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 5.0
"#;

    const EPP: &str = r#"# HELP inference_pool_ready_pods [ALPHA] The number of ready pods in the inference server pool.
# TYPE inference_pool_ready_pods gauge
inference_pool_ready_pods{name="vllm-llama3-8b-instruct"} 3
# HELP inference_pool_per_pod_queue_size [ALPHA] The total number of requests pending in the model server queue for each underlying pod.
# TYPE inference_pool_per_pod_queue_size gauge
inference_pool_per_pod_queue_size{model_server_pod="vllm-llama3-8b-instruct-5d8f7c-abcde",name="vllm-llama3-8b-instruct"} 2
inference_pool_per_pod_queue_size{model_server_pod="vllm-llama3-8b-instruct-5d8f7c-fghij",name="vllm-llama3-8b-instruct"} 0
# TYPE llm_d_epp_flow_control_queue_size gauge
llm_d_epp_flow_control_queue_size{inference_pool="vllm-llama3-8b-instruct",priority="0"} 12 1700000000000
"#;

    #[test]
    fn keeps_vllm_names_with_colons_and_reads_types() {
        let e = parse(VLLM).unwrap();
        let running: Vec<_> = e.named("vllm:num_requests_running").collect();
        assert_eq!(running.len(), 1);
        assert_eq!(running[0].value, 3.0);
        assert_eq!(
            running[0].labels["model_name"],
            "meta-llama/Llama-3.1-8B-Instruct"
        );
        assert_eq!(e.type_of("vllm:num_requests_running"), MetricType::Gauge);
        assert_eq!(e.type_of("vllm:num_preemptions_total"), MetricType::Counter);
        assert_eq!(
            e.type_of("vllm:time_to_first_token_seconds_bucket"),
            MetricType::Histogram
        );
        let info = e.named("vllm:cache_config_info").next().unwrap();
        assert_eq!(info.labels["num_gpu_blocks"], "27000");
        assert_eq!(
            e.families["vllm:kv_cache_usage_perc"].help.as_deref(),
            Some("KV-cache usage. 1 means 100 percent usage.")
        );
    }

    #[test]
    fn groups_histogram_buckets_sum_and_count() {
        let e = parse(VLLM).unwrap();
        let h = e.histogram("vllm:time_to_first_token_seconds");
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].labels.get("le"), None);
        assert_eq!(
            h[0].buckets,
            vec![(0.001, 0.0), (0.1, 4.0), (f64::INFINITY, 5.0)]
        );
        assert_eq!(h[0].sum, Some(0.75));
        assert_eq!(h[0].count, Some(5.0));
    }

    #[test]
    fn reads_endpoint_picker_metrics_with_timestamps() {
        let e = parse(EPP).unwrap();
        let per_pod: Vec<f64> = e
            .named("inference_pool_per_pod_queue_size")
            .map(|s| s.value)
            .collect();
        assert_eq!(per_pod, vec![2.0, 0.0]);
        let fc = e.named("llm_d_epp_flow_control_queue_size").next().unwrap();
        assert_eq!(fc.timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(fc.value, 12.0);
    }

    #[test]
    fn unescapes_label_values_and_help() {
        let text =
            "# HELP m a \\\\ b\\nc\nm{a=\"x\\\"y\",b=\"1\\\\2\",c=\"l1\\nl2\",d=\"{},=\"} 1\n";
        let e = parse(text).unwrap();
        let s = &e.samples[0];
        assert_eq!(s.labels["a"], "x\"y");
        assert_eq!(s.labels["b"], "1\\2");
        assert_eq!(s.labels["c"], "l1\nl2");
        assert_eq!(s.labels["d"], "{},=");
        assert_eq!(e.families["m"].help.as_deref(), Some("a \\ b\nc"));
    }

    #[test]
    fn reads_special_values_whitespace_and_trailing_commas() {
        let text = "a +Inf\nb -Inf\nc NaN\nd{x=\"1\",} 1e3\n  e { x = \"1\" }  2.5  \n# EOF\n";
        let e = parse(text).unwrap();
        assert_eq!(e.samples[0].value, f64::INFINITY);
        assert_eq!(e.samples[1].value, f64::NEG_INFINITY);
        assert!(e.samples[2].value.is_nan());
        assert_eq!(e.samples[3].value, 1000.0);
        assert_eq!(e.samples[4].labels["x"], "1");
        assert_eq!(e.samples[4].value, 2.5);
    }

    #[test]
    fn rejects_malformed_lines_with_their_number() {
        for bad in [
            "m{a=\"1\" 1",
            "m{a=1} 1",
            "m 1 2 3",
            "m abc",
            "m infinity",
            "1m 1",
            "m{a=\"1\",a=\"2\"} 1",
            "m{a=\"\\x\"} 1",
            "m",
            "# TYPE m bogus",
        ] {
            let err = parse(&format!("ok 1\n{bad}\n")).expect_err(bad);
            assert_eq!(err.line, 2, "{bad}: {err}");
        }
    }

    /// A random mix of valid lines, broken lines and bytes.
    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("vllm:num_requests_running{engine=\"0\"} 1".to_owned()),
            Just("# TYPE x histogram".to_owned()),
            Just("x_bucket{le=\"+Inf\"} 3".to_owned()),
            Just("{".to_owned()),
            Just("\"".to_owned()),
            Just("\\".to_owned()),
            Just("=".to_owned()),
            Just("# HELP".to_owned()),
            "[ -~]{0,20}",
            "\\PC{0,8}",
        ]
    }

    /// Fuzz-style: many random byte strings (seeded xorshift, so a failure
    /// reproduces), biased towards the characters the grammar cares about.
    #[test]
    fn random_bytes_never_panic() {
        const ALPHABET: &[u8] = b"ab_:{}=\",\"\\ \t\n#+-.eE019NaInf\xc3\xa9\xff";
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = (next() % 64) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize])
                .collect();
            let _ = parse(&String::from_utf8_lossy(&bytes));
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(text in "\\PC*") {
            let _ = parse(&text);
        }

        #[test]
        fn mixed_fragments_never_panic(parts in proptest::collection::vec(fragment(), 0..20)) {
            let _ = parse(&parts.concat());
            let _ = parse(&parts.join("\n"));
        }

        #[test]
        fn written_samples_read_back(
            name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
            labels in proptest::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,8}", "\\PC{0,12}", 0..4),
            value in proptest::num::f64::NORMAL | proptest::num::f64::ZERO,
        ) {
            let rendered: Vec<String> = labels
                .iter()
                .map(|(k, v)| {
                    let v = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
                    format!("{k}=\"{v}\"")
                })
                .collect();
            let line = format!("{name}{{{}}} {value:?}\n", rendered.join(","));
            let e = parse(&line).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(e.samples.len(), 1);
            prop_assert_eq!(&e.samples[0].name, &name);
            prop_assert_eq!(&e.samples[0].labels, &labels);
            prop_assert_eq!(e.samples[0].value, value);
        }
    }
}
