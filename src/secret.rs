//! Values that must never be printed: secrets and URLs that may carry a
//! password.

use std::fmt;

use serde::{Serialize, Serializer};
use url::Url;

/// The text every secret prints as.
pub const REDACTED: &str = "<redacted>";

/// What a URL password is replaced with when a URL is shown.
pub const MASKED_PASSWORD: &str = "****";

/// A secret file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// It could not be read.
    #[error("cannot read {path}: {source}")]
    Unreadable {
        /// The file.
        path: std::path::PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// It holds nothing (after trailing line breaks).
    #[error("{} is empty", path.display())]
    Empty {
        /// The file.
        path: std::path::PathBuf,
    },
}

/// Reads a secret from a file (Kubernetes secret mounts end with a line
/// break, which is not part of the secret). The one place secret files are
/// read: the config loader, and the CLI flags that name one.
pub fn read_secret_file(path: &std::path::Path) -> Result<Secret, SecretFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| SecretFileError::Unreadable {
        path: path.to_owned(),
        source,
    })?;
    let secret = text.trim_end_matches(['\r', '\n']);
    if secret.is_empty() {
        return Err(SecretFileError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(Secret::new(secret))
}

/// `Display`, `Serialize` and `Debug` (formatted by `$debug`) show only
/// the text of `$shown`, so the value itself can never be printed.
macro_rules! shown_as {
    ($t:ty, $shown:expr, $debug:literal) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&$shown(self))
            }
        }
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&$shown(self))
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, $debug, $shown(self))
            }
        }
    };
}

shown_as!(Secret, |_: &Secret| REDACTED, "{}");
shown_as!(EndpointUrl, EndpointUrl::masked, "EndpointUrl({})");

/// A secret string (token, password). `Debug`, `Display` and `Serialize`
/// print `<redacted>`; only [`Secret::expose`] returns the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret value, for the one place that sends it (a header, AUTH).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// A URL that may hold a password in its userinfo (`redis://:pw@host`).
/// `Debug`, `Display` and `Serialize` mask the password; [`EndpointUrl::expose`]
/// returns the full URL for the client that connects with it.
#[derive(Clone, PartialEq, Eq)]
pub struct EndpointUrl(Url);

impl EndpointUrl {
    /// Wraps a parsed URL.
    pub fn new(url: Url) -> Self {
        Self(url)
    }

    /// The URL including any password, for connecting.
    pub fn expose(&self) -> &Url {
        &self.0
    }

    /// True when the URL carries a password in its userinfo.
    pub fn has_password(&self) -> bool {
        self.0.password().is_some()
    }

    /// The URL as text with its password replaced by `****`.
    pub fn masked(&self) -> String {
        mask_url(&self.0)
    }
}

/// A URL's text with the password (if any) replaced by `****`.
pub fn mask_url(url: &Url) -> String {
    if url.password().is_none() {
        return url.to_string();
    }
    let mut shown = url.clone();
    // Setting a password only fails for URLs that cannot have one (no
    // host), and those cannot have had a password to begin with.
    if shown.set_password(Some(MASKED_PASSWORD)).is_err() {
        return REDACTED.to_owned();
    }
    shown.to_string()
}
