//! Export the KV transport's probe points from the test binaries too (as the `custody` binary
//! does), so probe tests can attach to them by name.
fn main() {
    println!("cargo::rustc-link-arg-tests=-Wl,--export-dynamic-symbol=custody_kv_*");
}
