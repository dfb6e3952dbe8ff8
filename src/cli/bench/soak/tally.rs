//! The soak's account of results against submissions: each result read
//! counts for its id (`bench-<i>`); at the end, ids answered, lost, and
//! answered more than once. Pure: the transports read, this counts.

/// Results counted per id so far.
pub(super) struct Tally {
    seen: Vec<u32>,
    results: u64,
    foreign: u64,
    answered: u64,
}

/// Results counted against submissions.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Account {
    /// Result records read.
    pub(super) results: u64,
    /// Ids with at least one result.
    pub(super) answered: u64,
    /// Ids without one.
    pub(super) lost: u64,
    /// Ids with more than one.
    pub(super) twice: u64,
    /// Results beyond the first of each id, and results of no id we sent.
    pub(super) extra: u64,
}

impl Tally {
    /// Nothing answered of `messages` submissions.
    pub(super) fn new(messages: usize) -> Self {
        Self {
            seen: vec![0; messages],
            results: 0,
            foreign: 0,
            answered: 0,
        }
    }

    /// One result for `id` (`None`: a result we cannot read an id from).
    pub(super) fn record(&mut self, id: Option<&str>) {
        self.results += 1;
        let index = id
            .and_then(|id| id.strip_prefix("bench-")?.parse::<usize>().ok())
            .filter(|i| *i < self.seen.len());
        match index {
            Some(i) => {
                if self.seen[i] == 0 {
                    self.answered += 1;
                }
                self.seen[i] += 1;
            }
            None => self.foreign += 1,
        }
    }

    /// One result record as JSON text (its `id` field).
    pub(super) fn record_json(&mut self, text: &[u8]) {
        let value = serde_json::from_slice::<serde_json::Value>(text).ok();
        self.record(value.as_ref().and_then(|v| v["id"].as_str()));
    }

    /// Up to `n` ids not answered yet.
    pub(super) fn missing(&self, n: usize) -> Vec<String> {
        (self.seen.iter().enumerate())
            .filter(|(_, k)| **k == 0)
            .take(n)
            .map(|(i, _)| format!("bench-{i}"))
            .collect()
    }

    /// Ids answered at least once.
    pub(super) fn answered(&self) -> u64 {
        self.answered
    }

    pub(super) fn account(&self) -> Account {
        let twice = self.seen.iter().filter(|n| **n > 1).count() as u64;
        let extra = (self.seen.iter())
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum::<u64>()
            + self.foreign;
        Account {
            results: self.results,
            answered: self.answered,
            lost: self.seen.len() as u64 - self.answered,
            twice,
            extra,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_ids_answered_lost_and_twice_and_foreign_results() {
        let mut t = Tally::new(4);
        t.record(Some("bench-0"));
        t.record_json(br#"{"id":"bench-2","status_code":200}"#);
        t.record(Some("bench-2"));
        t.record(Some("bench-9"));
        t.record(Some("other"));
        t.record_json(b"not json");
        assert_eq!(t.answered(), 2);
        assert_eq!(
            t.account(),
            Account {
                results: 6,
                answered: 2,
                lost: 2,
                twice: 1,
                extra: 4,
            }
        );
    }
}
