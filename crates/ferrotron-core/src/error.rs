use std::path::PathBuf;

/// Errors in descriptions (configs, presets, layouts): every one names where the bad value came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: not valid JSON: {msg}")]
    Json { file: PathBuf, msg: String },
    #[error("{file}: field `{field}`: {msg}")]
    Field {
        file: PathBuf,
        field: String,
        msg: String,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ConfigError>;
