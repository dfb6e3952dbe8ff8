//! The PromQL the simulated Prometheus answers: exactly the shapes the
//! catalogue gates send (`agg(selector)`, `min(timestamp(selector))`, a bare
//! selector), evaluated over one scrape of the simulated pool. Anything
//! else is a rejected query, as a real Prometheus rejects what it cannot
//! parse, so a gate that needs more fails closed here instead of reading a
//! made-up value.

use std::collections::BTreeMap;

use crate::source::{Exposition, PromSample, PromVector, SourceError};

/// An aggregation without `by`: one series without labels, or none when
/// its input is empty (as in Prometheus).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Aggregation {
    Sum,
    Avg,
    Max,
    Min,
    Count,
}

/// The expressions answered.
#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Selector(Selector),
    Timestamp(Selector),
    Aggregate(Aggregation, Box<Expr>),
}

/// `name{label="value",...}` with equality matchers only.
#[derive(Debug, Clone, PartialEq)]
struct Selector {
    name: String,
    matchers: BTreeMap<String, String>,
}

/// A parsed query, ready to evaluate against scrapes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Query(Expr);

impl Query {
    /// Parses `text`, or says why the simulated Prometheus cannot answer it.
    pub(crate) fn parse(text: &str) -> Result<Self, SourceError> {
        parse_expr(text.trim())
            .map(Query)
            .ok_or_else(|| SourceError::Query(format!(
                "the simulated Prometheus answers only agg(selector), timestamp(selector) and selectors with = matchers: {text}"
            )))
    }

    /// Evaluates against one scrape taken at `scraped_at` (the server's Unix
    /// seconds); `None` (no visible scrape: a blackout, or before the first)
    /// answers an empty vector, as Prometheus does for series gone stale.
    pub(crate) fn evaluate(&self, scrape: Option<(f64, &Exposition)>) -> PromVector {
        match scrape {
            Some((at, page)) => eval(&self.0, at, page),
            None => Vec::new(),
        }
    }
}

fn parse_expr(s: &str) -> Option<Expr> {
    if let Some(open) = s.find('(') {
        let (func, rest) = s.split_at(open);
        let inner = rest.strip_prefix('(')?.strip_suffix(')')?.trim();
        let agg = match func.trim() {
            "timestamp" => return parse_selector(inner).map(Expr::Timestamp),
            "sum" => Aggregation::Sum,
            "avg" => Aggregation::Avg,
            "max" => Aggregation::Max,
            "min" => Aggregation::Min,
            "count" => Aggregation::Count,
            _ => return None,
        };
        return parse_expr(inner).map(|e| Expr::Aggregate(agg, Box::new(e)));
    }
    parse_selector(s).map(Expr::Selector)
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn parse_selector(s: &str) -> Option<Selector> {
    let (name, labels) = match s.find('{') {
        Some(i) => (&s[..i], Some(s[i + 1..].strip_suffix('}')?)),
        None => (s, None),
    };
    let name = name.trim();
    if name.is_empty() || !name.chars().all(is_name_char) {
        return None;
    }
    let mut matchers = BTreeMap::new();
    let mut rest = labels.unwrap_or("").trim();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let label = rest[..eq].trim();
        if label.is_empty() || !label.chars().all(is_name_char) {
            return None;
        }
        let (value, after) = parse_string(rest[eq + 1..].trim_start())?;
        matchers.insert(label.to_owned(), value);
        rest = after.trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Some(Selector {
        name: name.to_owned(),
        matchers,
    })
}

/// A double-quoted PromQL string with `\"` and `\\` escapes; returns the
/// value and what follows it.
fn parse_string(s: &str) -> Option<(String, &str)> {
    let body = s.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &body[i + 1..])),
            '\\' => out.push(chars.next()?.1),
            c => out.push(c),
        }
    }
    None
}

fn select<'a>(sel: &'a Selector, page: &'a Exposition) -> impl Iterator<Item = PromSample> + 'a {
    page.named(&sel.name)
        .filter(|s| s.matches(&sel.matchers))
        .map(|s| {
            let mut labels = s.labels.clone();
            labels.insert("__name__".to_owned(), s.name.clone());
            PromSample {
                labels,
                value: s.value,
            }
        })
}

fn eval(expr: &Expr, scraped_at: f64, page: &Exposition) -> PromVector {
    match expr {
        Expr::Selector(sel) => select(sel, page).collect(),
        Expr::Timestamp(sel) => select(sel, page)
            .map(|mut s| {
                s.labels.remove("__name__");
                s.value = scraped_at;
                s
            })
            .collect(),
        Expr::Aggregate(agg, inner) => {
            let values: Vec<f64> = eval(inner, scraped_at, page)
                .into_iter()
                .map(|s| s.value)
                .collect();
            if values.is_empty() {
                return Vec::new();
            }
            let n = values.len() as f64;
            let value = match agg {
                Aggregation::Sum => values.iter().sum(),
                Aggregation::Avg => values.iter().sum::<f64>() / n,
                Aggregation::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                Aggregation::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
                Aggregation::Count => n,
            };
            vec![PromSample {
                labels: BTreeMap::new(),
                value,
            }]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::text;

    fn page() -> Exposition {
        text::parse(
            "vllm:num_requests_running{inference_pool=\"p\",pod=\"p-0\"} 3\n\
             vllm:num_requests_running{inference_pool=\"p\",pod=\"p-1\"} 5\n\
             vllm:num_requests_running{inference_pool=\"q\",pod=\"q-0\"} 100\n\
             llm_d_epp_ready_endpoints{name=\"p\"} 2\n",
        )
        .unwrap()
    }

    fn value(q: &str) -> Option<f64> {
        let page = page();
        let v = Query::parse(q).unwrap().evaluate(Some((1000.0, &page)));
        v.first().map(|s| s.value)
    }

    #[test]
    fn answers_the_catalogue_shapes() {
        assert_eq!(
            value("sum(vllm:num_requests_running{inference_pool=\"p\"})"),
            Some(8.0)
        );
        assert_eq!(
            value("avg(vllm:num_requests_running{inference_pool=\"p\"})"),
            Some(4.0)
        );
        assert_eq!(
            value("max(llm_d_epp_ready_endpoints{name=\"p\"})"),
            Some(2.0)
        );
        assert_eq!(
            value("min(timestamp(vllm:num_requests_running{inference_pool=\"p\"}))"),
            Some(1000.0)
        );
        assert_eq!(value("count(vllm:num_requests_running)"), Some(3.0));
    }

    #[test]
    fn missing_series_and_invisible_scrapes_answer_nothing() {
        assert_eq!(value("sum(inference_pool_ready_pods{name=\"p\"})"), None);
        let q = Query::parse("vllm:num_requests_running").unwrap();
        assert!(q.evaluate(None).is_empty());
    }

    #[test]
    fn escaped_label_values_match() {
        let page = text::parse("m{a=\"x\\\"y\"} 1\n").unwrap();
        let q = Query::parse(r#"sum(m{a="x\"y"})"#).unwrap();
        assert_eq!(q.evaluate(Some((0.0, &page)))[0].value, 1.0);
    }

    #[test]
    fn other_promql_is_rejected_not_guessed() {
        for q in [
            "rate(vllm:num_requests_running[1m])",
            "1 - sum(x)",
            "sum by (pod) (x)",
            "x{a=~\"b.*\"}",
        ] {
            assert!(matches!(Query::parse(q), Err(SourceError::Query(_))), "{q}");
        }
    }
}
