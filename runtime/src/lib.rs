//! Custody's engine: model loading (GGUF weights, tokenizer, chat template), the Llama-family
//! forward pass, the tagged KV page pool, admission and continuous batching, and sampling.
//!
//! Architecture invariants: this crate knows nothing of Parquet, DataFusion or BPF. All compute
//! goes through `custody-kernels`; all KV reads go through the kernel's tag-checking attention.

pub mod actor;
pub mod config;
pub mod disagg;
pub mod engine;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod tokenizer;

/// The KV transports (their own crate: no engine, no pool, no async runtime).
pub use custody_transport as transport;

pub use config::{Config, EngineConfig};
pub use engine::{
    AdmissionError, Engine, Event, FinishReason, GenerateRequest, RequestId, StartupError,
};
pub use model::Model;
pub use sampling::SamplingParams;
pub use tokenizer::{ChatMessage, Tokenizer};
