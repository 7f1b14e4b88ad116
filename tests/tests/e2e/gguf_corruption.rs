//! Corrupt or truncated GGUF files give a clear error, never a panic or out-of-bounds read — on
//! the real model file.

use std::io::Write;

use custody_runtime::Model;
use custody_runtime::gguf::{Gguf, GgufError};

fn write_tmp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("custody-gguf-{}-{name}", std::process::id()));
    std::fs::File::create(&p)
        .and_then(|mut f| f.write_all(bytes))
        .expect("write");
    p
}

#[test]
fn truncated_model_files_are_clear_errors() {
    let full = std::fs::read(custody_tests::model_path()).expect("read model");
    let g = Gguf::open(&custody_tests::model_path()).expect("valid");
    let data_start = g.tensors.values().map(|t| t.start).min().expect("tensors");
    // Cut points across the header, metadata, tensor infos and the data section.
    let mut cuts = vec![
        0,
        3,
        4,
        7,
        8,
        15,
        23,
        24,
        100,
        1000,
        10_000,
        100_000,
        data_start - 1,
        data_start + 10,
        full.len() / 2,
        full.len() - 1,
    ];
    cuts.extend((1..40).map(|i| i * data_start / 40));
    for cut in cuts {
        let p = write_tmp(&format!("cut{cut}"), &full[..cut]);
        let r = Model::load(&p);
        let _ = std::fs::remove_file(&p);
        let e = r.expect_err(&format!("a file cut at {cut} bytes must not load"));
        let msg = e.to_string();
        assert!(
            msg.contains("truncated")
                || msg.contains("outside the file")
                || msg.contains("not a GGUF"),
            "cut at {cut}: unclear error: {msg}"
        );
    }
}

#[test]
fn byte_flips_in_the_header_never_panic() {
    let full = std::fs::read(custody_tests::model_path()).expect("read model");
    let g = Gguf::open(&custody_tests::model_path()).expect("valid");
    let data_start = g.tensors.values().map(|t| t.start).min().expect("tensors");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut errors = 0;
    for i in 0..60 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut b = full.clone();
        // Flip bytes in the structural part (the first 64 KiB of metadata and the tensor infos).
        let region = if i % 2 == 0 { 65_536 } else { data_start };
        let at = (seed % region as u64) as usize;
        b[at] ^= 0xff;
        let p = write_tmp(&format!("flip{i}"), &b);
        if let Err(e) = Model::load(&p) {
            errors += 1;
            assert!(!e.to_string().is_empty());
        }
        let _ = std::fs::remove_file(&p);
    }
    assert!(errors > 0, "some flips must be detected");
}

#[test]
fn specific_header_corruptions_name_what_is_wrong() {
    let full = std::fs::read(custody_tests::model_path()).expect("read model");
    let mut b = full[..4096].to_vec();
    b[..4].copy_from_slice(b"GGML");
    let p = write_tmp("magic", &b);
    assert!(matches!(Gguf::open(&p), Err(GgufError::BadMagic { .. })));
    let mut b = full[..4096].to_vec();
    b[4..8].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&p, &b).expect("write");
    assert!(matches!(
        Gguf::open(&p),
        Err(GgufError::UnsupportedVersion(99))
    ));
    let _ = std::fs::remove_file(&p);
    let e = Model::load(std::path::Path::new("/nonexistent/model.gguf")).expect_err("missing");
    assert!(e.to_string().contains("/nonexistent/model.gguf"));
}
