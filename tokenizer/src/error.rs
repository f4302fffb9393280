//! The crate's one error type.

use std::fmt;

/// Why a tokenizer could not be loaded or an input could not be encoded.
///
/// Messages name the offending component (`normalizer.Sequence[1].Replace`, ...), so a
/// caller that sees one knows what to change or which fallback to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrorKind {
    Io,
    Json,
    Unsupported,
    Invalid,
    Truncation,
}

impl Error {
    pub(crate) fn io(path: &str, err: &std::io::Error) -> Self {
        Self::new(ErrorKind::Io, format!("cannot read {path}: {err}"))
    }
    pub(crate) fn json(err: &serde_json::Error) -> Self {
        Self::new(
            ErrorKind::Json,
            format!("tokenizer.json is not valid JSON: {err}"),
        )
    }
    pub(crate) fn unsupported(component: &str, detail: impl fmt::Display) -> Self {
        Self::new(
            ErrorKind::Unsupported,
            format!("unsupported {component}: {detail}"),
        )
    }
    pub(crate) fn invalid(component: &str, detail: impl fmt::Display) -> Self {
        Self::new(ErrorKind::Invalid, format!("invalid {component}: {detail}"))
    }
    pub(crate) fn truncation(detail: impl fmt::Display) -> Self {
        Self::new(ErrorKind::Truncation, format!("truncation error: {detail}"))
    }
    fn new(kind: ErrorKind, message: String) -> Self {
        Self { kind, message }
    }

    /// True when the file uses a component this crate does not implement (the caller
    /// may fall back to another tokenizer library).
    pub fn is_unsupported(&self) -> bool {
        self.kind == ErrorKind::Unsupported
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}
