//! API keys: `tenant:key` entries (commas or newlines between them, `#`
//! comments in a file), from `serve.api_keys` (the environment) and
//! `serve.api_keys_file`. Each key maps to one tenant; several keys may
//! share a tenant (rotation).

use std::path::{Path, PathBuf};

/// A bad key list.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The key file could not be read.
    #[error("serve.api_keys_file: cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// An entry is not `tenant:key`.
    #[error("{origin}: entry {n} is not `tenant:key` with a non-empty tenant and key")]
    Entry {
        /// `serve.api_keys` or the file.
        origin: String,
        /// 1-based entry number.
        n: usize,
    },
    /// Two entries give one key to two tenants.
    #[error("{origin}: a key is given to two tenants ({first} and {second})")]
    Conflict {
        /// Where the second entry is.
        origin: String,
        /// The first tenant.
        first: String,
        /// The second tenant.
        second: String,
    },
}

/// The configured keys; empty means no authentication (one tenant,
/// `default`), which the server allows on loopback only.
#[derive(Debug, Default, Clone)]
pub struct Keys {
    entries: Vec<(String, String)>,
}

/// The tenant of every request when no keys are configured.
pub const ANONYMOUS_TENANT: &str = "default";

impl Keys {
    /// Parses the inline list and the file (either may be absent).
    pub fn load(inline: Option<&str>, file: Option<&Path>) -> Result<Self, KeysError> {
        let mut keys = Self::default();
        if let Some(text) = inline {
            keys.add(text, "serve.api_keys")?;
        }
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| KeysError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            keys.add(&text, &path.display().to_string())?;
        }
        Ok(keys)
    }

    fn add(&mut self, text: &str, origin: &str) -> Result<(), KeysError> {
        let entries = text
            .split(['\n', ','])
            .map(|e| e.split('#').next().unwrap_or_default().trim())
            .filter(|e| !e.is_empty());
        for (i, entry) in entries.enumerate() {
            let Some((tenant, key)) = entry.split_once(':') else {
                return Err(KeysError::Entry {
                    origin: origin.to_owned(),
                    n: i + 1,
                });
            };
            let (tenant, key) = (tenant.trim(), key.trim());
            if tenant.is_empty() || key.is_empty() {
                return Err(KeysError::Entry {
                    origin: origin.to_owned(),
                    n: i + 1,
                });
            }
            if let Some((_, first)) = self.entries.iter().find(|(k, _)| k == key) {
                if first != tenant {
                    return Err(KeysError::Conflict {
                        origin: origin.to_owned(),
                        first: first.clone(),
                        second: tenant.to_owned(),
                    });
                }
                continue;
            }
            self.entries.push((key.to_owned(), tenant.to_owned()));
        }
        Ok(())
    }

    /// Whether any key is configured.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every tenant a request can have, sorted: the keys' tenants, or
    /// [`ANONYMOUS_TENANT`] without keys.
    pub fn tenants(&self) -> Vec<String> {
        if self.entries.is_empty() {
            return vec![ANONYMOUS_TENANT.to_owned()];
        }
        let mut tenants: Vec<String> = self.entries.iter().map(|(_, t)| t.clone()).collect();
        tenants.sort();
        tenants.dedup();
        tenants
    }

    /// The tenant of a presented key; `None` when it matches no key.
    /// Without keys every caller is [`ANONYMOUS_TENANT`].
    pub fn tenant(&self, presented: Option<&str>) -> Option<String> {
        if self.entries.is_empty() {
            return Some(ANONYMOUS_TENANT.to_owned());
        }
        let presented = presented?;
        // Every key is compared in full, so the time taken does not tell
        // how much of a key was right.
        let mut found = None;
        for (key, tenant) in &self.entries {
            if constant_time_eq(key.as_bytes(), presented.as_bytes()) {
                found = Some(tenant.clone());
            }
        }
        found
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_bad_entries_are_refused() {
        let keys = Keys::load(Some("acme:k1, acme:k2\nglobex:k3 # ops"), None).expect("parses");
        assert_eq!(keys.tenant(Some("k2")).as_deref(), Some("acme"));
        assert_eq!(keys.tenant(Some("k3")).as_deref(), Some("globex"));
        assert_eq!(keys.tenant(Some("k4")), None);
        assert_eq!(keys.tenant(None), None);
        assert!(matches!(
            Keys::load(Some("acme"), None),
            Err(KeysError::Entry { n: 1, .. })
        ));
        assert!(matches!(
            Keys::load(Some("a:k,b:k"), None),
            Err(KeysError::Conflict { .. })
        ));
        let open = Keys::default();
        assert_eq!(open.tenant(None).as_deref(), Some(ANONYMOUS_TENANT));
    }
}
