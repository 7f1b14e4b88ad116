//! Compiles the control-plane protos with the pure-Rust `protox` (no `protoc` needed).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo::rerun-if-changed=proto/disagg.proto");
    let fds = protox::compile(["disagg.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
