//! Custody's benchmarks, behind `custody bench`, `custody bench-disagg`, `custody bench-router`
//! and `custody audit bench`: each figure against a reference measured in the same run
//! (`BENCHMARKS.md`). Their statistics live in [`stats`] (one median for all of them). The
//! binary parses the command line (each benchmark's options derive `clap::Args`), loads what
//! the benchmark runs on, and hands it over; what a benchmark prints is its output.

pub mod audit;
pub mod constrained;
pub mod disagg;
pub mod engine;
pub mod offload;
pub mod router;
pub mod stats;

/// A failure's cause, whatever its crate's error type.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a benchmark did not finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A step failed (what was being done, and why).
    #[error("{what}: {source}")]
    Step { what: String, source: BoxError },
    /// Its input or its result is not what a measurement needs.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Writer(#[from] custody_audit::writer::WriterError),
    #[error(transparent)]
    Startup(#[from] custody_runtime::StartupError),
    #[error(transparent)]
    Offload(#[from] custody_runtime::offload::OffloadError),
    #[error(transparent)]
    Admission(#[from] custody_runtime::AdmissionError),
    #[error(transparent)]
    Model(#[from] custody_runtime::model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] custody_runtime::tokenizer::TokenizerError),
    #[error(transparent)]
    Grammar(#[from] custody_runtime::grammar::GrammarError),
    #[error(transparent)]
    Pair(#[from] custody_runtime::disagg::client::PairError),
    #[error(transparent)]
    Tls(#[from] custody_runtime::disagg::tls::TlsError),
    #[error(transparent)]
    Witness(#[from] custody_ebpf::WitnessError),
    #[error(transparent)]
    Addr(#[from] std::net::AddrParseError),
    #[error(transparent)]
    Sink(#[from] custody_audit::SinkError),
    #[error(transparent)]
    Collect(#[from] custody_ebpf::collector::CollectError),
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// What was being done when a step failed (`anyhow::Context`'s shape, typed).
pub trait Context<T> {
    fn context(self, what: &str) -> Result<T>;
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<BoxError>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: &str) -> Result<T> {
        self.with_context(|| what.to_owned())
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| BenchError::Step {
            what: what(),
            source: e.into(),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: &str) -> Result<T> {
        self.ok_or_else(|| BenchError::Invalid(what.to_owned()))
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.ok_or_else(|| BenchError::Invalid(what()))
    }
}

/// Return a [`BenchError::Invalid`] with this message.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::BenchError::Invalid(format!($($t)*)))
    };
}
pub(crate) use bail;

/// Make a pool of `threads` compute threads (0: one per core) the process's default, for
/// engines that step on threads of their own (the pairs here). The first call wins.
pub fn set_default_pool(threads: usize) -> Result<()> {
    let pool = custody_runtime::par::ThreadPool::new(threads)
        .context("building the compute thread pool")?;
    if custody_runtime::par::set_global(pool).is_err() {
        tracing::debug!("the process's compute pool was already set");
    }
    Ok(())
}

/// Bytes of sealed Parquet under `root`.
pub fn parquet_bytes(root: &std::path::Path) -> Result<u64> {
    let mut bytes = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("listing {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                bytes += std::fs::metadata(&p)?.len();
            }
        }
    }
    Ok(bytes)
}
