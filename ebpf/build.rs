//! Compiles the BPF programs (`bpf/*.bpf.c`) with clang for the `bpf` target into `OUT_DIR`.
//!
//! `-g` is required: aya reads the maps' definitions from the object's BTF. Without clang the
//! crate still builds (so does the rest of the workspace) but the loader reports
//! `WitnessError::ObjectNotBuilt` at run time, and the witness tests fail under `CI=true`.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=bpf/witness.bpf.c");
    println!("cargo::rerun-if-env-changed=CUSTODY_BPF_CLANG");
    println!("cargo::rustc-check-cfg=cfg(custody_bpf_missing)");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let obj = out.join("witness.bpf.o");
    let clang = std::env::var("CUSTODY_BPF_CLANG").unwrap_or_else(|_| "clang".to_owned());
    let status = Command::new(&clang)
        .args([
            "-O2",
            "-g",
            "-target",
            "bpf",
            "-D__TARGET_ARCH_x86",
            "-I/usr/include/x86_64-linux-gnu",
            "-Wall",
            "-Werror",
            "-c",
            "bpf/witness.bpf.c",
            "-o",
        ])
        .arg(&obj)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{clang} failed to compile bpf/witness.bpf.c ({s})"),
        Err(e) => {
            println!(
                "cargo::warning=custody-ebpf: {clang} not runnable ({e}); the BPF object is not \
                 built and the witness will refuse to load (apt-get install clang libbpf-dev \
                 linux-libc-dev, or scripts/setup.sh)"
            );
            println!("cargo::rustc-cfg=custody_bpf_missing");
            std::fs::write(&obj, b"").expect("write the empty placeholder object");
        }
    }
}
