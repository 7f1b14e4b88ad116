//! A test that finds its input missing (a file, a CPU feature, a device, a permission) does not
//! pass on nothing: it calls [`skip`], which
//! - says so on stderr, past the test harness's capture (a passing test's output is hidden);
//! - appends one line, `test<TAB>reason<TAB>required|optional`, to the suite's skip log —
//!   `$CUSTODY_SKIP_LOG`, else `<target dir>/test-skips.txt` — which `scripts/test.sh` counts and
//!   prints at the end of every run;
//! - panics under `CI=true` when the input is [`Need::OnCi`]: there, its absence is a broken
//!   machine or setup, not a reason.
//!
//! No dependencies: every crate's tests may use it (kernels', the transport's, the witness's).

use std::io::Write;
use std::path::PathBuf;

/// Whether CI's machines have the input (this machine class: x86-64, root, BPF,
/// iproute2/nftables, the packages `scripts/setup.sh` installs; AVX-512 VNNI on some hosts only;
/// no GPU, no RDMA device, no requantized model files).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// CI has it: a skip there fails the test.
    OnCi,
    /// CI may lack it: the skip is counted and printed, never a failure.
    Optional,
}

/// The skip log's path: `$CUSTODY_SKIP_LOG`, else `test-skips.txt` in the target directory
/// (`$CARGO_TARGET_DIR`, else the workspace's `target/`).
pub fn log_path() -> PathBuf {
    if let Some(p) = std::env::var_os("CUSTODY_SKIP_LOG") {
        return p.into();
    }
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target")))
        .join("test-skips.txt")
}

/// Whether this run is CI's (`CI=true`).
pub fn on_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Record that `test` (its path, e.g. `e2e::quant_types::…`) did not run (or ran only in part)
/// because of `reason`; panics under `CI=true` when `need` is [`Need::OnCi`]. The caller returns
/// (or leaves out the part) after it.
pub fn skip(test: &str, reason: &str, need: Need) {
    record(&log_path(), test, reason, need);
}

fn record(path: &std::path::Path, test: &str, reason: &str, need: Need) {
    let kind = match need {
        Need::OnCi => "required",
        Need::Optional => "optional",
    };
    let reason_line = reason.replace(['\n', '\t'], " ");
    // Straight to stderr, not through `eprintln!`, which the harness captures for a passing test.
    // Best effort: a closed stderr must not turn a skip into a different failure.
    let _ = writeln!(
        std::io::stderr(),
        "\nSKIPPED {test}: {reason_line} ({kind} on CI)\n"
    );
    if let Some(dir) = path.parent() {
        // Best effort, as the open below reports what matters.
        let _ = std::fs::create_dir_all(dir);
    }
    // One `write` of one line with O_APPEND: lines of parallel tests do not interleave.
    let line = format!("{test}\t{reason_line}\t{kind}\n");
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
    {
        Ok(()) => {}
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "(the skip could not be logged to {}: {e})",
                path.display()
            );
        }
    }
    assert!(
        !(need == Need::OnCi && on_ci()),
        "{test} CANNOT RUN: {reason_line} (CI=true: this input must be there)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_logged_as_one_line() {
        let path =
            std::env::temp_dir().join(format!("custody-skip-log-{}.txt", std::process::id()));
        record(&path, "skip::self_test", "no\tinput\nhere", Need::Optional);
        let text = std::fs::read_to_string(&path).expect("log");
        assert_eq!(text, "skip::self_test\tno input here\toptional\n");
        // Best effort cleanup of a temporary file.
        let _ = std::fs::remove_file(&path);
    }
}
