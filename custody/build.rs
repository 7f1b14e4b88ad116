//! Export the KV transport's probe points in the dynamic symbol table, so that uprobes (the eBPF
//! witness) can attach by name to the running binary.
fn main() {
    println!("cargo::rustc-link-arg-bins=-Wl,--export-dynamic-symbol=custody_kv_*");
}
