//! No way around the tag check in a binary: the `custody` executable built with its default
//! features (what `scripts/run.sh` builds and users run) contains no fault injection, no test
//! oracle and no raw-KV accessor. Those sit behind the runtime's `fault-injection` and
//! `test-oracle` features, which only this test crate enables.
//!
//! The workspace test build unifies this crate's features into every binary it builds, so
//! `scripts/test.sh` builds the default-features binary first (`cargo build -p custody`) and
//! keeps a copy at `target/default-features/custody` (or `$CUSTODY_DEFAULT_FEATURES_BIN`).

use std::path::PathBuf;
use std::process::Command;

/// Symbol-name fragments that must not exist in a default-features binary.
const FORBIDDEN: &[&str] = &[
    "fault_inject",
    "FaultInjector",
    "FaultInjection",
    "DecodeFault",
    "PrefillFault",
    "test_oracle",
    "inspect_k_blocking",
    "k_cache",
    "v_cache",
];

fn defined_symbols(bin: &std::path::Path) -> Vec<String> {
    let out = Command::new("nm")
        .args(["--defined-only", "--demangle"])
        .arg(bin)
        .output()
        .expect("nm (binutils) runs");
    assert!(out.status.success(), "nm {}: {:?}", bin.display(), out);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

pub(crate) fn default_features_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("CUSTODY_DEFAULT_FEATURES_BIN") {
        return p.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("default-features/custody")
}

#[test]
fn default_features_binary_has_no_fault_injection_test_oracle_or_raw_kv_symbols() {
    // The scanner sees such symbols where they exist: this test binary links the runtime with
    // both features and calls into them.
    let own = defined_symbols(&std::env::current_exe().expect("test exe"));
    assert!(
        own.iter().any(|s| s.contains("fault_inject"))
            && own.iter().any(|s| s.contains("test_oracle")),
        "the positive control failed: no fault-injection / oracle symbol in the test binary"
    );
    let bin = default_features_binary();
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p custody && mkdir -p target/default-features \
         && cp target/debug/custody target/default-features/` (scripts/test.sh does)",
        bin.display()
    );
    let syms = defined_symbols(&bin);
    for krate in ["custody_engine", "custody_disagg", "custody_transport"] {
        assert!(
            syms.iter().any(|s| s.contains(krate)),
            "{}: no {krate} symbols at all (stripped?)",
            bin.display()
        );
    }
    let found: Vec<&String> = syms
        .iter()
        .filter(|s| FORBIDDEN.iter().any(|f| s.contains(f)))
        .collect();
    assert!(
        found.is_empty(),
        "{} carries test-only entry points: {found:#?}",
        bin.display()
    );
}
