//! `custody bench-router`: what one routing decision costs — the router's own `plan` (its lock,
//! the length and capacity checks, the cache-aware prefill choice over a prompt's chain keys,
//! power of two choices for decode, the alternatives' JSON for its log) and the index update of
//! an admission — on fleets of 1×1 to 64×64 synthetic ready nodes, with and without prefix keys.
//! The latency a request gains through the router on real nodes is `scripts/bench-router.py`;
//! the policy's balance at 64×64 is `cargo run --release -p custody-router --example sim`.

use crate::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchRouterArgs {
    /// Decisions timed per fleet size.
    #[arg(long, default_value_t = 100_000)]
    decisions: u32,
    /// Chain keys per request (full prompt pages) for the cache-aware rows.
    #[arg(long, default_value_t = 16)]
    prompt_pages: usize,
}

pub fn bench_router(a: BenchRouterArgs) -> Result<()> {
    println!(
        "| prefill × decode | prompt pages (chain keys) | decisions | ns / decision | decisions / s |"
    );
    println!("|---|--:|--:|--:|--:|");
    for (p, d) in [(1, 1), (2, 2), (8, 8), (64, 64)] {
        for pages in [0, a.prompt_pages] {
            let c = custody_server::fleet::bench_routing(p, d, pages, a.decisions);
            println!(
                "| {} × {} | {} | {} | {:.0} | {:.0} |",
                c.prefill_nodes,
                c.decode_nodes,
                c.prompt_pages,
                c.decisions,
                c.ns_per_decision,
                c.decisions_per_s
            );
        }
    }
    Ok(())
}
