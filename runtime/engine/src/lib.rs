//! Custody's synchronous engine: model loading (GGUF weights, tokenizer, chat template), the
//! Llama-family forward pass, the tagged KV page pool, admission and continuous batching,
//! sampling, the request protocol's state machine, and the engine-thread actor.
//!
//! Architecture invariants: this crate knows no network and no async runtime (no tokio, no
//! tonic); nothing of Parquet, DataFusion or BPF. On the CPU backend all compute goes through
//! `custody-kernels` and the only read of K/V is `kv::PagePool::attend`, the kernel's
//! tag-checking attention over the pool's own tags; on the CUDA backend (`cuda_forward`, over
//! `custody-cuda`'s `Device`) the only read is the device attention kernel, which checks the
//! same tags first. It depends on `custody-transport` only for the `KeyInvalidated` proof that
//! lets quarantined pages go (the transports' code is never called from here).
// Every result in runtime/ is handled or dropped with its reason (`Discard`), never `let _ =`.
#![deny(clippy::let_underscore_must_use)]

pub mod actor;
pub mod config;
pub mod cuda_check;
pub mod cuda_forward;
pub mod cuda_speed;
pub mod decoding;
pub mod doors;
pub mod engine;
pub mod gguf;
pub mod grammar;
pub mod kv;
pub mod model;
pub mod offload;
pub mod prefix_cache;
pub mod protocol;
pub mod sampling;
pub mod tokenizer;
pub mod tools;

/// The compute thread pool the kernels run on (`custody-kernels`'s): a caller installs one
/// around engine steps, or sets the process's default.
pub use custody_kernels::par;

pub use config::EngineConfig;
pub use engine::{
    AdmissionError, DecodeEngine, Engine, Event, FinishReason, GenerateRequest, PrefillEngine,
    RequestId, StartupError,
};
pub use model::Model;
pub use sampling::SamplingParams;
pub use tokenizer::{ChatMessage, Tokenizer};
