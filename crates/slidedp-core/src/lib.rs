//! slidedp host engine.
//!
//! Owns everything that lives in host memory during training: the shared-memory state store
//! (FP32 master weights, Adam moments, BF16 staging rings, per-layer version gates) and the SIMD
//! kernels that update it. Nothing here knows about Python; `slidedp-py` is the thin binding.

pub mod error;
pub mod kernels;
pub mod model;
pub mod solve;
pub mod store;
pub mod update;

pub use error::{Error, Result};
