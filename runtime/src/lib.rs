//! `custody-runtime`: the one import for the binary, the server and the tests — a facade over
//! the runtime's crates, with no code of its own:
//! - `custody-engine` (`runtime/engine`): the synchronous engine (model, GGUF, tokenizer, page
//!   pool, scheduler, protocol state machine, engine-thread actor); knows no network;
//! - `custody-transport` (`runtime/transport`): the KV transports (trait, tcp, verbs);
//! - `custody-disagg` (`runtime/disagg`): the disaggregated nodes (gRPC proto, prefill,
//!   decode, client);
//! - `custody-probe-abi` (`runtime/probe-abi`): the probe ABI the eBPF witness observes.
// Every result in runtime/ is handled or dropped with its reason (`Discard`), never `let _ =`.
#![deny(clippy::let_underscore_must_use)]

pub use custody_disagg as disagg;
pub use custody_engine::{
    AdmissionError, ChatMessage, Engine, EngineConfig, Event, FinishReason, GenerateRequest, Model,
    RequestId, SamplingParams, StartupError, Tokenizer,
};
pub use custody_engine::{
    actor, config, cuda_check, cuda_forward, cuda_speed, decoding, engine, gguf, grammar, kv,
    model, offload, par, prefix_cache, protocol, sampling, tokenizer, tools,
};
/// The object-store tier of KV offload (`custody-offload-s3`).
pub use custody_offload_s3 as offload_s3;
pub use custody_transport as transport;
