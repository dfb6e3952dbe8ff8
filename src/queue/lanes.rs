//! Tenant lanes (issue 22), what every transport with lanes shares: the
//! dispatcher's fairness settings, a message's tenant, and the weighted
//! round robin a claim takes the lanes' heads by. The embedded store
//! (`embedded/lanes.rs`) and the in-memory queue (`memory.rs`) use these;
//! the Redis transport runs the same round robin in its claim script.

use std::collections::{BTreeMap, HashSet};
use std::hash::Hash;

use serde::Deserialize;

/// The dispatcher's fairness settings, for the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantLanes {
    /// `[gateway] fairness_attribute`: the metadata key naming the tenant.
    pub attribute: String,
    /// `dispatch.tenant_weights`: members taken per round (1 when not named).
    pub weights: BTreeMap<String, u32>,
}

impl TenantLanes {
    /// The weight of `tenant` (1 when not named).
    pub fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1)
    }
}

/// The tenant of a message: `metadata[attribute]` of the request (bare or
/// in an envelope's `data`); `""` without one or when it cannot be read.
pub(crate) fn tenant_of(body: &[u8], attribute: &str) -> String {
    #[derive(Deserialize)]
    struct Request {
        #[serde(default)]
        metadata: BTreeMap<String, serde_json::Value>,
    }
    #[derive(Deserialize)]
    struct Message {
        data: Option<Request>,
        #[serde(default)]
        metadata: BTreeMap<String, serde_json::Value>,
    }
    let Ok(message) = serde_json::from_slice::<Message>(body) else {
        return String::new();
    };
    let metadata = match message.data {
        Some(data) => data.metadata,
        None => message.metadata,
    };
    match metadata.get(attribute) {
        Some(serde_json::Value::String(tenant)) => tenant.clone(),
        _ => String::new(),
    }
}

/// Round robin over `sources` (each with its weight: members taken per
/// round), skipping keys already taken, up to `max`.
pub(crate) fn interleave<T, K: Eq + Hash>(
    sources: Vec<(u32, Vec<T>)>,
    max: usize,
    key: impl Fn(&T) -> K,
) -> Vec<T> {
    let mut sources: Vec<(u32, std::vec::IntoIter<T>)> = sources
        .into_iter()
        .map(|(weight, items)| (weight, items.into_iter()))
        .collect();
    let mut taken = HashSet::new();
    let mut out = Vec::new();
    loop {
        let mut any = false;
        for (weight, items) in &mut sources {
            for _ in 0..*weight {
                if out.len() >= max {
                    return out;
                }
                let Some(item) = items.next() else { break };
                any = true;
                if taken.insert(key(&item)) {
                    out.push(item);
                }
            }
        }
        if !any {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_is_the_attribute_of_a_bare_request_or_an_envelope() {
        let bare = br#"{"id":"a","metadata":{"userid":"alice"}}"#;
        let envelope = br#"{"data":{"id":"a","metadata":{"userid":"bob"}},"internal":{}}"#;
        assert_eq!(tenant_of(bare, "userid"), "alice");
        assert_eq!(tenant_of(envelope, "userid"), "bob");
        assert_eq!(tenant_of(bare, "team"), "");
        assert_eq!(tenant_of(br#"{"metadata":{"userid":7}}"#, "userid"), "");
        assert_eq!(tenant_of(b"not json", "userid"), "");
    }

    #[test]
    fn interleave_takes_each_weight_per_round_and_skips_repeats() {
        let got = interleave(
            vec![
                (3, vec![1, 2, 3, 4, 5, 6]),
                (1, vec![10, 11]),
                (1, vec![1, 2, 10]),
            ],
            8,
            |x| *x,
        );
        assert_eq!(got, vec![1, 2, 3, 10, 4, 5, 6, 11]);
        let all = interleave(vec![(1, vec![1, 2]), (2, vec![3])], 10, |x| *x);
        assert_eq!(all, vec![1, 3, 2]);
        assert!(interleave(vec![(1, vec![1])], 0, |x| *x).is_empty());
    }
}
