//! Compiles the control-plane protos with the pure-Rust `protox` (no `protoc` needed).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo::rerun-if-changed=proto/disagg.proto");
    let fds = protox::compile(["disagg.proto"], ["proto"])?;
    // `KvPairing` carries the KV transport's pairing secret: its `Debug` is written by hand
    // (`lib.rs`), redacted, so no `{:?}` of a handshake reply can log it.
    tonic_prost_build::configure()
        .skip_debug(["custody.disagg.v1.KvPairing"])
        .compile_fds(fds)?;
    Ok(())
}
