use std::path::PathBuf;

/// Engine errors. Each names the file (and the tensor or field) it is about.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] ferrotron_core::ConfigError),
    #[error("{file}: {source}")]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: {msg}")]
    Format { file: PathBuf, msg: String },
    #[error("{file}: tensor `{name}` is missing")]
    MissingTensor { file: PathBuf, name: String },
    #[error("{file}: tensor `{name}` has shape {found:?}, the model needs {expected:?}")]
    Shape {
        file: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// An object store refused or could not be reached; `location` is the URL.
    #[error("{location}: {msg}")]
    Storage { location: String, msg: String },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
    /// A device went over the capacity it was given; `at` is what it held, by term, at that moment.
    #[error("device {device} is out of memory: it needed more than its capacity of {} at this moment:\n{}", crate::memory::format_bytes(*capacity), crate::memory::format_terms(at))]
    OutOfMemory {
        device: usize,
        capacity: u64,
        at: Box<crate::memory::MemoryTerms>,
    },
    /// A training run went out of memory: the breakdown at that moment beside the planner's
    /// prediction for the same layout.
    #[error("{0}")]
    RunOutOfMemory(String),
    /// Another device of the run went out of memory, and this one stopped with it.
    #[error("{0}")]
    PeerOutOfMemory(String),
    /// The run was asked to stop (SIGTERM, SIGINT) and stopped after `step`, its checkpoint saved.
    #[error("stopped by {} after step {step}: {saved}", signal_name(*signal))]
    Preempted {
        signal: i32,
        step: usize,
        saved: String,
    },
    /// The loss or the gradient norm went non-finite: the run stops there, saving nothing.
    #[error("{0}")]
    NonFinite(String),
}

/// A stopping signal's name.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        _ => "a stopping signal",
    }
}

impl EngineError {
    /// The process exit status this error asks for: 128 + the signal for a preempted run.
    pub fn exit_code(&self) -> i32 {
        match self {
            EngineError::Preempted { signal, .. } => 128 + signal,
            _ => 1,
        }
    }
}

impl EngineError {
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            file: file.into(),
            source,
        }
    }
    pub fn format(file: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Self::Format {
            file: file.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
