//! `cargo run -p custody-tests --example gpu_model [-- --batches 1,8 --ctx 1024 --shapes 1b,8b]`:
//! the CUDA engine's performance model, counted on the CPU (see `custody_tests::gpu_model`),
//! printed as Markdown tables for BENCHMARKS.md.

use custody_tests::gpu_model::{self, LLAMA_3_1_8B, LLAMA_3_2_1B};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx: usize = arg("--ctx", "1024").parse()?;
    let vocab: usize = arg("--counted-vocab", "1024").parse()?;
    let batches: Vec<usize> = arg("--batches", "1,8")
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    for name in arg("--shapes", "1b,8b").split(',') {
        let shape = match name {
            "1b" => LLAMA_3_2_1B,
            "8b" => LLAMA_3_1_8B,
            other => return Err(format!("unknown shape {other:?}: 1b or 8b").into()),
        };
        for &batch in &batches {
            let t = std::time::Instant::now();
            let m = gpu_model::decode_step(shape, batch, ctx, vocab)?;
            println!("{}", gpu_model::render(&m));
            eprintln!(
                "({} batch {batch}: counted in {:.1} s)",
                shape.name,
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}
