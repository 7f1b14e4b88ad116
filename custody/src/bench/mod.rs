//! The benchmarks: each figure against a reference measured in the same run (`BENCHMARKS.md`).
//! Their statistics live in [`stats`] (one median for all of them).

pub(crate) mod audit;
pub(crate) mod disagg;
pub(crate) mod engine;
pub(crate) mod router;
pub(crate) mod stats;
