//! Configuration errors: every error names the key (and the variable or
//! flag it came from) and says what is allowed.

/// One problem found while loading or validating the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", self.at())]
pub struct ConfigError {
    /// The key path in the file's terms, e.g. `queue[0].gate_params.baseline`.
    pub key: String,
    /// Where the offending value came from when it was not the file: an
    /// environment variable (`SLUICEGATE_GATE_PARAMS`) or a flag (`--listen`).
    pub origin: Option<String>,
    /// What is wrong and what is allowed, lowercase.
    pub message: String,
}

impl ConfigError {
    /// An error for `key` with no recorded origin.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            origin: None,
            message: message.into(),
        }
    }

    /// Where the error is: the key, after its origin when that differs.
    fn at(&self) -> String {
        match &self.origin {
            Some(origin) if *origin != self.key => format!("{origin} ({})", self.key),
            _ => self.key.clone(),
        }
    }

    /// The same error, attributed to an environment variable or flag.
    pub fn with_origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = Some(origin.into());
        self
    }
}

/// Every problem found while loading, in the order found, one per line.
/// Never empty when returned by the config loader (`Config::load`); derefs to
/// the slice of errors.
#[derive(Debug, Clone, PartialEq, Eq, Default, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    /// The individual errors.
    pub fn errors(&self) -> &[ConfigError] {
        &self.0
    }
}

impl std::ops::Deref for ConfigErrors {
    type Target = [ConfigError];
    fn deref(&self) -> &[ConfigError] {
        &self.0
    }
}
