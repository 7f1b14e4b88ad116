//! Runs the routing-policy simulation on a 64×64 fleet for every prefill × decode policy pair
//! and prints one markdown table row per pair.
//!
//! `CARGO_TARGET_DIR=/tmp/router-target cargo run --release -p custody-router --example sim`

use std::time::Instant;

use custody_router::sim::{DecodePolicyKind, PrefillPolicyKind, SimConfig, SimReport, run};

const PREFILL_POLICIES: [PrefillPolicyKind; 3] = [
    PrefillPolicyKind::CacheAware,
    PrefillPolicyKind::LeastLoaded,
    PrefillPolicyKind::Random,
];
const DECODE_POLICIES: [DecodePolicyKind; 2] =
    [DecodePolicyKind::PowerOfTwo, DecodePolicyKind::Random];

/// Runs one configuration and fills in the decision rate, which `run` leaves to its caller.
/// The rate divides routed requests by the whole run's wall time, so it includes the
/// simulation's own bookkeeping (workload generation, events, the nodes' caches): a lower bound
/// on the policy's own speed.
fn timed_run(cfg: &SimConfig) -> SimReport {
    let start = Instant::now();
    let mut report = run(cfg);
    let elapsed_s = start.elapsed().as_secs_f64();
    report.decisions_per_sec_cpu = if elapsed_s > 0.0 {
        f64::from(report.routed) / elapsed_s
    } else {
        0.0
    };
    report
}

fn main() {
    let base = SimConfig::fleet(64, 64);
    println!(
        "SimConfig::fleet(64, 64): {} requests at {:.3}/ms, {} tenants × {} prefixes × {} pages, \
         1..={} unique pages, 1..={} output tokens, page {} tokens, decode pool {} pages, \
         prefill cache {} pages, prefill {} ms/page ({} ms cached), decode {:.2} ms/token, seed {:#x}",
        base.requests,
        base.arrivals_per_ms,
        base.tenants,
        base.prefixes_per_tenant,
        base.prefix_pages,
        base.unique_pages,
        base.output_tokens,
        base.page_size,
        base.decode_pool_pages,
        base.prefill_cache_pages,
        base.prefill_ms_per_page,
        base.cached_page_ms,
        base.decode_ms_per_token,
        base.seed,
    );
    println!();
    println!(
        "| prefill | decode | requests | routed | refused_no_capacity | cache_hit_pages_ratio \
         | prefill_load_max_over_mean | decode_pages_max_over_mean | decode_peak_pages_max \
         | mean_queue_ms | p99_queue_ms | decisions_per_sec_cpu (incl. sim bookkeeping) |"
    );
    println!("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for prefill_policy in PREFILL_POLICIES {
        for decode_policy in DECODE_POLICIES {
            let cfg = SimConfig {
                prefill_policy,
                decode_policy,
                ..base.clone()
            };
            let r = timed_run(&cfg);
            println!(
                "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {:.2} | {:.2} | {:.0} |",
                prefill_policy.name(),
                decode_policy.name(),
                r.requests,
                r.routed,
                r.refused_no_capacity,
                r.cache_hit_pages_ratio,
                r.prefill_load_max_over_mean,
                r.decode_pages_max_over_mean,
                r.decode_peak_pages_max,
                r.mean_queue_ms,
                r.p99_queue_ms,
                r.decisions_per_sec_cpu,
            );
        }
    }
}
