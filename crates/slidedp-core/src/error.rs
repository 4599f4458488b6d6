//! The engine's one error type. Every variant carries the numbers a user needs to act on it; the
//! binding maps each variant onto one Python exception class (see `slidedp-py`).

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "not enough space in {path} for the host store: {needed_bytes} bytes needed, \
         {available_bytes} available; free memory there or enlarge it (a tmpfs such as /dev/shm: \
         `mount -o remount,size=SIZE /dev/shm`), or train a smaller model"
    )]
    OutOfSharedMemory {
        path: String,
        needed_bytes: u64,
        available_bytes: u64,
    },

    #[error("host store '{name}' cannot be attached: {reason}")]
    StoreAttach { name: String, reason: String },

    #[error("layer {layer} is out of range: the store has {layers} layers")]
    LayerOutOfRange { layer: usize, layers: usize },

    #[error("parameter '{name}' is not in the store layout")]
    UnknownParameter { name: String },

    #[error("invalid store layout: {0}")]
    InvalidLayout(String),

    #[error(
        "timed out after {timeout_ms} ms waiting for layer {layer} to reach version {expected} \
         (it is at {got}); the process that updates it may have died"
    )]
    VersionTimeout {
        layer: usize,
        expected: u32,
        got: u32,
        timeout_ms: u64,
    },

    #[error(
        "the host store was poisoned by a failed peer while waiting on layer {layer}; see that \
         process's error"
    )]
    StorePoisoned { layer: usize },

    /// `first`: this failure poisoned the store before any other (the one reported when
    /// several ranks' updates fail together).
    #[error("a parameter update failed: {message}")]
    UpdateFailed { message: String, first: bool },

    #[error("{pending} parameter updates still pending after {timeout_ms} ms")]
    UpdateTimeout { pending: usize, timeout_ms: u64 },

    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("instruction set '{isa}' is not supported by this CPU (best available: {best})")]
    IsaUnsupported { isa: String, best: String },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Wraps an OS error with what we were doing when it happened.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
