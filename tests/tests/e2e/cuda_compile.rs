//! The CUDA kernels' compile tier: every `kernels/cuda/*.cu` compiles with NVRTC 13.0 for sm_90
//! to a CUBIN with no register spills and registers, shared memory and occupancy within the budgets of
//! `kernels/cuda/budgets.json` (`scripts/nvrtc-check.py`; NVRTC from PyPI wheels that
//! `scripts/setup.sh` installs — no GPU). Missing NVRTC is a failure with instructions, not a
//! skip.

#[test]
fn every_kernel_compiles_for_sm90_within_its_budget() {
    check(&[]);
}

/// The kernels as the CUDA device compiles them at run time: one unit
/// (`custody_cuda::module_source()`), every kernel the forward pass launches present.
#[test]
fn the_runtime_module_compiles_as_one_unit_within_the_budgets() {
    let dir = crate::audit::tmp_dir("nvrtc-unit");
    let unit = dir.join("custody_module.cu");
    std::fs::write(&unit, custody_cuda::module_source()).expect("write the unit");
    let report = check(&["--unit".as_ref(), unit.as_os_str()]);
    for k in custody_cuda::Kernel::ALL {
        assert!(
            report["kernels"][k.name()]["cubin_bytes"]
                .as_u64()
                .unwrap_or(0)
                > 0,
            "{k:?} missing from the unit: {report}"
        );
    }
}

fn check(extra: &[&std::ffi::OsStr]) -> serde_json::Value {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("python3")
        .arg(root.join("scripts/nvrtc-check.py"))
        .arg("--json")
        .args(extra)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nvrtc-check failed (scripts/setup.sh installs NVRTC):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("json report");
    assert_eq!(
        report["nvrtc"], "13.0",
        "pinned to CUDA 13.0 (driver 580 on the lent GPUs)"
    );
    // Every kernel the host launches.
    for k in custody_cuda::Kernel::ALL.iter().map(|k| k.name()) {
        let r = &report["kernels"][k];
        assert!(
            r["cubin_bytes"].as_u64().unwrap_or(0) > 0,
            "{k}: no CUBIN: {r}"
        );
        assert_eq!(r["spill_stores"], 0, "{k}: {r}");
        assert!(
            r["occupancy"].as_f64().is_some_and(|o| o > 0.0),
            "{k}: no occupancy: {r}"
        );
        assert_eq!(r["spill_loads"], 0, "{k}: {r}");
    }
    report
}
