//! End-to-end tests across Custody's crates, on the real embedded model.

mod arch_models;
mod audit;
mod checkpoint;
mod cli;
mod cluster;
mod configs;
mod cuda_compile;
mod cuda_forward;
mod cuda_kernels;
mod default_audit;
mod disagg;
mod fleet;
mod gguf_corruption;
mod gpu_model;
mod integrity;
mod kv_auth;
mod kv_cache_type;
mod kv_offload;
mod long_context;
mod model_check;
mod netns;
mod prefix_cache;
mod protocol;
mod quant_types;
mod reference;
mod report;
mod roles;
mod s3;
mod scheduler;
mod serve;
mod structured;
mod symbols;
mod synth;
mod threads;
mod tlog;
mod tls;
mod witness;

use custody_runtime::gguf::Gguf;
use custody_runtime::{Engine, EngineConfig, Model, Tokenizer};

/// An engine over the embedded model with a small pool (fast to start, big enough for tests).
pub fn engine_with(cfg: EngineConfig) -> Engine {
    let model = Model::load(&custody_tests::model_path()).expect("load model");
    Engine::new(model, cfg).expect("engine starts")
}

pub fn small_cfg() -> EngineConfig {
    EngineConfig {
        context_length: Some(2048),
        kv_budget_mib: 64,
        ..EngineConfig::default()
    }
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&Gguf::open(&custody_tests::model_path()).expect("gguf"))
        .expect("tokenizer")
}
