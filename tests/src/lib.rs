//! Shared helpers for Custody's end-to-end tests (one integration-test crate: every test binary
//! links everything, so there is exactly one).

use std::path::PathBuf;

pub mod cuda_shim;
pub mod gpu_model;

/// A test whose input is missing says so through this (counted in the suite's skip log, a
/// failure under `CI=true` when CI has the input): see [`custody_test_skip`].
pub use custody_test_skip::{Need, skip};

/// The embedded default model. The README's test command fetches it first; a missing model is a
/// test failure with instructions, never a silent skip.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("CUSTODY_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            std::env::var_os("CUSTODY_CACHE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".cache/custody"))
                .join("SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        p.exists(),
        "model not found at {}: run scripts/fetch-model.sh (the README's test command does)",
        p.display()
    );
    p
}

/// `tests/fixtures/…`
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

/// Read a little-endian f32 `.npy` (version 1/2/3, C order): (shape, data).
pub fn read_npy_f32(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    read_npy_words(path, "'<f4'", f32::from_le_bytes)
}

/// Read a little-endian i32 `.npy` (version 1/2/3, C order): (shape, data).
pub fn read_npy_i32(path: &std::path::Path) -> (Vec<usize>, Vec<i32>) {
    read_npy_words(path, "'<i4'", i32::from_le_bytes)
}

/// An `.npy` of 4-byte elements of type `descr`, each decoded by `word`.
fn read_npy_words<T>(
    path: &std::path::Path,
    descr: &str,
    word: fn([u8; 4]) -> T,
) -> (Vec<usize>, Vec<T>) {
    let (shape, body) = read_npy(path, descr);
    let data: Vec<T> = body
        .chunks_exact(4)
        .map(|c| word([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// An `.npy` file's shape and raw body, its header checked to declare `descr` in C order.
fn read_npy(path: &std::path::Path, descr: &str) -> (Vec<usize>, Vec<u8>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_eq!(&b[..6], b"\x93NUMPY", "not an npy file");
    let (hlen, start) = if b[6] == 1 {
        (u16::from_le_bytes([b[8], b[9]]) as usize, 10)
    } else {
        (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12)
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).expect("header");
    assert!(
        header.contains(descr) && header.contains("'fortran_order': False"),
        "{}: {header}, expected {descr}",
        path.display()
    );
    let shape_s = &header[header.find("'shape': (").expect("shape") + 10..];
    let shape: Vec<usize> = shape_s[..shape_s.find(')').expect(")")]
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().expect("dim"))
        .collect();
    (shape, b[start + hlen..].to_vec())
}
