//! The CUDA backend's forward pass end to end on the CUDA-on-CPU shim: synthetic Llama models
//! (two layers, random weights in each GGUF type the engine reads) run through
//! `custody_engine::cuda_forward::CudaForward` — every step a kernel of `kernels/cuda`, the
//! K/V in the device pool, the tag check inside the attention kernel — give the CPU backend's
//! logits within a stated tolerance and its greedy tokens wherever the top-2 margin is clear,
//! under three schedule seeds (bit-identical across seeds: no races); a batch's integrity
//! failures (stale, foreign, unwritten) are the CPU's, exactly, while the batch's other
//! segments still get their logits.

use custody_kernels::DType;
use custody_kernels::attention::{IntegrityError, KvType, PageRef, Reader, ReduceOrder, TagCheck};
use custody_runtime::cuda_check::{compare_with_cpu, tolerance};
use custody_runtime::cuda_forward::CudaForward;
use custody_runtime::gguf::write::Synthetic;
use custody_runtime::kv::PagePool;
use custody_runtime::model::{Logits, Model, Rows, Scratch, Segment};
use custody_tests::cuda_shim::ShimDevice;

const SEEDS: [u64; 3] = [0, 0x9E37_79B9_7F4A_7C15, 0xD1B5_4A32_D192_ED03];
const PAGE_SIZE: usize = 8;
const N_PAGES: usize = 64;

fn model(dtype: DType, seed: u64) -> Model {
    custody_runtime::cuda_check::load(&Synthetic::tiny(dtype, seed)).expect("synthetic model")
}

fn pool(m: &Model) -> PagePool {
    PagePool::new(
        m.page_geometry(PAGE_SIZE, KvType::F16),
        m.config.n_layers,
        N_PAGES,
    )
}

/// One sequence's state, the same on both backends' pools (same allocation order).
struct Seq {
    owner: u64,
    tokens: Vec<u32>,
    pages: Vec<PageRef>,
}

fn segment<'a>(s: &'a Seq, start: usize, logits: Logits) -> Segment<'a> {
    Segment {
        tokens: &s.tokens[start..],
        start_pos: start,
        block_table: &s.pages,
        reader: Reader::private(s.owner),
        logits,
        order: if s.tokens.len() - start >= 2 {
            ReduceOrder::Gemm
        } else {
            ReduceOrder::Vec
        },
        rows: if s.tokens.len() - start >= 2 {
            Rows::Prompt {
                len: s.tokens.len(),
                chunk: s.tokens.len(),
            }
        } else {
            Rows::Decode
        },
        check: TagCheck::Enforced,
    }
}

fn rel_err(cpu: &[f32], gpu: &[f32]) -> f32 {
    assert_eq!(cpu.len(), gpu.len());
    let d = cpu
        .iter()
        .zip(gpu)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    d / cpu.iter().fold(1e-6f32, |m, x| m.max(x.abs()))
}

#[test]
fn the_device_forward_pass_gives_the_cpu_logits_for_every_weight_type() {
    for dtype in [
        DType::F32,
        DType::F16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::BF16,
    ] {
        let m = model(dtype, 7);
        let mut first: Option<Vec<f32>> = None;
        for seed in SEEDS {
            let a = compare_with_cpu(ShimDevice::new(seed), &m, dtype, 4).expect("compare");
            eprintln!(
                "{dtype:?} seed {seed:#x}: max |Δlogit| / max |logit| = {:.2e} (tolerance {:.0e}); greedy {}/{} agree",
                a.max_rel_err,
                tolerance(dtype),
                a.greedy_agreed,
                a.greedy_compared
            );
            assert!(
                a.pass(),
                "{dtype:?}: max rel err {:.2e}, greedy {}/{}, {} clear disagreements",
                a.max_rel_err,
                a.greedy_agreed,
                a.greedy_compared,
                a.clear_disagreements
            );
            assert_eq!(a.greedy_compared, 8);
            match &first {
                None => first = Some(a.device_logits),
                Some(f) => assert!(
                    f.iter()
                        .zip(&a.device_logits)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{dtype:?}: logits differ between schedule seeds (a race)"
                ),
            }
        }
    }
}

/// A batch with a good segment and three bad ones: the bad ones fail with the CPU's errors,
/// exactly; the good one's logits are unaffected.
#[test]
fn integrity_failures_on_the_device_are_the_cpus() {
    integrity_failures(false);
}

/// The same failures in a kernel-by-kernel step (a 260-row prompt beside them makes it one):
/// the prompt's rows go to the tensor-core prefill kernel and the short segments' rows to flash
/// decoding through its row list — the verdicts are the CPU's, the good rows' logits too.
#[test]
fn integrity_failures_in_the_prefill_kernel_are_the_cpus() {
    integrity_failures(true);
}

fn integrity_failures(eager: bool) {
    use custody_cuda::Kernel;
    let m = model(DType::Q8_0, 5);

    let mut cpu_pool = pool(&m);
    let mut dev_pool = pool(&m);
    let mut dev =
        CudaForward::new(ShimDevice::counting(SEEDS[1]), &m, &dev_pool, 320).expect("upload");
    let mut scratch = Scratch::default();
    let both =
        |f: &mut dyn FnMut(&mut PagePool) -> Vec<PageRef>, a: &mut PagePool, b: &mut PagePool| {
            let x = f(a);
            assert_eq!(f(b), x);
            x
        };
    let good = Seq {
        owner: 1,
        tokens: (0..10).collect(),
        pages: both(
            &mut |p| p.alloc(1, 2).expect("alloc"),
            &mut cpu_pool,
            &mut dev_pool,
        ),
    };
    // Stale: pages released and handed to someone else; the old table is kept.
    let stale_pages = both(
        &mut |p| p.alloc(2, 2).expect("alloc"),
        &mut cpu_pool,
        &mut dev_pool,
    );
    for p in [&mut cpu_pool, &mut dev_pool] {
        p.release(2, &stale_pages).expect("release");
        p.alloc(3, 2).expect("realloc");
    }
    let stale = Seq {
        owner: 2,
        tokens: (0..4).collect(),
        pages: stale_pages,
    };
    // Foreign: a table naming the good sequence's pages.
    let foreign = Seq {
        owner: 4,
        tokens: (0..3).collect(),
        pages: good.pages.clone(),
    };
    // Unwritten: decoding at position 8 (the second page's first slot, a valid write) over a
    // first page nobody wrote — the attention kernel's check refuses it.
    let unwritten = Seq {
        owner: 5,
        tokens: (0..9).collect(),
        pages: both(
            &mut |p| p.alloc(5, 2).expect("alloc"),
            &mut cpu_pool,
            &mut dev_pool,
        ),
    };
    // Out of order: a write at slot 5 of a fresh page (the write side's check, on the pool).
    let out_of_order = Seq {
        owner: 6,
        tokens: (0..6).collect(),
        pages: both(
            &mut |p| p.alloc(6, 1).expect("alloc"),
            &mut cpu_pool,
            &mut dev_pool,
        ),
    };
    let long = Seq {
        owner: 7,
        tokens: (0..260).map(|t| (t * 7 % 256) as u32).collect(),
        pages: both(
            &mut |p| p.alloc(7, 33).expect("alloc"),
            &mut cpu_pool,
            &mut dev_pool,
        ),
    };
    let mut segs = vec![
        segment(&good, 0, Logits::All),
        segment(&stale, 0, Logits::Last),
        segment(&foreign, 0, Logits::Last),
        segment(&unwritten, 8, Logits::Last),
        segment(&out_of_order, 5, Logits::Last),
    ];
    if eager {
        segs.push(segment(&long, 0, Logits::Last));
    }
    let cpu = m.forward(&mut cpu_pool, &segs, &mut scratch);
    dev.device_mut().take_counts();
    let gpu = dev.forward(&mut dev_pool, &segs).expect("device forward");
    // Eager: the 260-row prompt through the prefill kernel, every other row (all shorter than
    // a 16-row tile) through flash decoding, each layer.
    let launches = dev.device_mut().take_counts();
    let count = |k: Kernel| launches.iter().filter(|l| l.kernel == k).count();
    assert_eq!(
        (count(Kernel::FlashPrefill), count(Kernel::FlashDecode)),
        (if eager { m.config.n_layers } else { 0 }, m.config.n_layers)
    );
    for i in std::iter::once(0).chain(eager.then_some(5)) {
        let c = cpu[i].as_ref().expect("good on cpu");
        let g = gpu[i].as_ref().expect("good on device");
        assert!(rel_err(c, g) <= tolerance(DType::Q8_0), "segment {i}");
    }
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate().take(5).skip(1) {
        let (c, g) = (
            c.as_ref().expect_err("bad on cpu"),
            g.as_ref().expect_err("bad on device"),
        );
        assert_eq!(c, g, "segment {i}");
    }
    assert!(
        matches!(cpu[1], Err(IntegrityError::StaleGeneration { .. })),
        "{:?}",
        cpu[1]
    );
    assert!(
        matches!(cpu[2], Err(IntegrityError::ForeignOwner { .. })),
        "{:?}",
        cpu[2]
    );
    assert!(
        matches!(cpu[3], Err(IntegrityError::UnwrittenSlot { .. })),
        "{:?}",
        cpu[3]
    );
    assert!(
        matches!(cpu[4], Err(IntegrityError::OutOfOrderWrite { .. })),
        "{:?}",
        cpu[4]
    );
}

/// The incident reproduction's disabled tag check does not exist on the device.
#[test]
fn the_device_refuses_a_disabled_tag_check() {
    let m = model(DType::F16, 1);
    let mut p = pool(&m);
    let mut dev = CudaForward::new(ShimDevice::new(0), &m, &p, 8).expect("upload");
    let s = Seq {
        owner: 1,
        tokens: vec![1, 2],
        pages: p.alloc(1, 1).expect("alloc"),
    };
    let mut seg = segment(&s, 0, Logits::Last);
    seg.check = TagCheck::DisabledForIncidentReproduction;
    let e = dev.forward(&mut p, &[seg]).expect_err("refused");
    assert!(e.to_string().contains("cannot be disabled"), "{e}");
}

/// The backend boundary: the engine — admission, continuous batching, the pool's tags, events —
/// is the same code on the CUDA backend. The same requests, batched together, give the same
/// greedy tokens and the same event stream on the shim as on the CPU; the startup pool sizing
/// is the same; and the disaggregated roles refuse a device-resident KV pool.
#[test]
fn the_engine_on_the_cuda_backend_serves_the_cpus_tokens() {
    use custody_runtime::config::EngineConfig;
    use custody_runtime::engine::{Engine, Event, GenerateRequest};
    let cfg = EngineConfig {
        context_length: Some(128),
        page_size: 8,
        kv_budget_mib: 1,
        max_batch_tokens: 48,
        ..EngineConfig::default()
    };
    let mut cpu = Engine::new(model(DType::F32, 7), cfg.clone()).expect("cpu engine");
    let mut dev = Engine::new_on_device(
        model(DType::F32, 7),
        cfg,
        Box::new(ShimDevice::new(SEEDS[2])),
    )
    .expect("device engine");
    assert!(dev.kv_on_device() && !cpu.kv_on_device());
    let run = |e: &mut Engine| {
        for (i, len) in [9usize, 17, 30].into_iter().enumerate() {
            e.submit(GenerateRequest {
                decoding: Default::default(),
                prompt: (0..len as u32)
                    .map(|t| (t * 13 + i as u32 * 7) % 256)
                    .collect(),
                max_tokens: 5,
                sampling: Default::default(),
                stop_ids: vec![],
                tenant: format!("t{i}"),
                cache: None,
            })
            .expect("admitted");
        }
        let mut events = Vec::new();
        for _ in 0..64 {
            let step = e.step();
            events.extend(step);
            if events
                .iter()
                .filter(|ev| matches!(ev, Event::Finished { .. }))
                .count()
                == 3
            {
                break;
            }
        }
        events
    };
    let (c, d) = (run(&mut cpu), run(&mut dev));
    // A context past the first kernel's 8,192 slots starts (flash decoding has no cap; its
    // long-context results are `cuda_kernels`' tests).
    let long = EngineConfig {
        context_length: Some(9000),
        ..EngineConfig::default()
    };
    let mut big = Synthetic::tiny(DType::F32, 7);
    big.context_length = 16384;
    let m = custody_runtime::cuda_check::load(&big).expect("model");
    if let Err(e) = Engine::new_on_device(m, long, Box::new(ShimDevice::new(0))) {
        panic!("a 9,000-token context on the device: {e}");
    }
    assert_eq!(
        c.iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count(),
        15,
        "{c:?}"
    );
    assert_eq!(c, d, "the same event stream on both backends");
}

/// The prefix cache and KV offload on the CUDA backend (`cuda_check::cache`, what `custody
/// gpu-check cache` runs on a GPU). The device's tag check admits what the CPU's does — a
/// reader's own pages and the shared pages of the namespaces it names (its tenant's and the
/// operator's public scope: two) — so cached pages are read in place on the device: a
/// follow-up's cached prompt, another tenant's public-scope hit, and, after every cached page
/// is evicted into a host tier (staged from the device, sealed) and restored (verified, staged
/// back onto the device), the device's uncached tokens, which on the shim are the CPU's bit for
/// bit, with the CPU backend's hit counts. A tenant sending another's exact prompt is served
/// only the public scope's pages.
#[test]
fn the_prefix_cache_and_kv_offload_on_the_cuda_backend_serve_the_cpus_tokens() {
    use custody_runtime::cuda_check::cache;
    let check = cache::cache_and_offload(
        Box::new(ShimDevice::new(SEEDS[1])),
        Box::new(ShimDevice::new(SEEDS[2])),
    )
    .expect("the check runs");
    assert_eq!(check.faults(), Vec::<String>::new(), "{check:#?}");
    assert!(check.cpu_agrees(), "the CPU's tokens and hits: {check:#?}");
    let cached: Vec<usize> = check.turns.iter().map(|t| t.device.cached_tokens).collect();
    assert_eq!(cached, [0, 40, 16, 16, 48, 16], "prefix-cache hits");
    assert!(
        check.restored >= 6 && check.offload.offloaded >= 6,
        "{check:#?}"
    );
}

/// Disaggregation on the CUDA backend is the same code: a prefill and a decode engine on the
/// shim, paired over the real tcp transport (mutual TLS, the authenticated KV connection, the
/// checksum verified on landing), serve the colocated CPU engine's greedy tokens. Prefill
/// stages its prompt pages from the device into host memory for the transfer; decode stages
/// the landed, verified pages onto its device before it reads them.
#[test]
fn a_disaggregated_pair_on_the_cuda_backend_serves_the_colocated_cpu_tokens() {
    use custody_runtime::config::{EngineConfig, UnsafeReproduction};
    use custody_runtime::engine::Engine;
    let cfg = EngineConfig {
        context_length: Some(128),
        page_size: 8,
        kv_budget_mib: 1,
        max_batch_tokens: 48,
        ..EngineConfig::default()
    };
    let prompts: Vec<Vec<u32>> = [11usize, 19, 26]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n as u32)
                .map(|t| (t * 29 + i as u32 * 3) % 256)
                .collect()
        })
        .collect();
    let mut colo = Engine::new(model(DType::F32, 7), cfg.clone()).expect("cpu engine");
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| crate::reference::greedy(&mut colo, p.clone(), 5))
        .collect();
    let m = model(DType::F32, 7);
    let fp = m.gguf().sha256_hex();
    let on_shim = |seed| {
        Engine::new_on_device(
            model(DType::F32, 7),
            cfg.clone(),
            Box::new(ShimDevice::new(seed)),
        )
        .expect("device engine")
    };
    let pair = crate::disagg::start_engines(
        on_shim(SEEDS[0]),
        on_shim(SEEDS[1]),
        fp,
        UnsafeReproduction::default(),
        std::time::Duration::from_secs(30),
        (None, None),
        false,
    );
    for (p, w) in prompts.iter().zip(&want) {
        let got = pair
            .generate(&crate::disagg::req("tenant-a", p.clone(), 5))
            .expect("generated");
        assert_eq!(&got.tokens, w, "prompt of {} tokens", p.len());
    }
}

/// Every architecture switch on the device (`ArchSpec`: NeoX RoPE, Llama 3 frequency factors,
/// Q/K/V biases, per-head Q/K norm with Q wider than the embedding, tied heads) and llama.cpp's
/// own K-quant mixes: the committed tiny models of `arch_models` (`tests/fixtures/arch`) give
/// the CPU backend's logits within a stated tolerance and its greedy tokens where the margin is
/// clear. The tolerance is looser than the synthetic models' (1e-3): these models' activations
/// are larger and their attention sharper (output norm ~5, Q/K at 2/√cols, as the generator
/// says), which grows f32 summation-order differences — measured 2026-12-02: up to 2.4e-3
/// (llama3.F32); a missing switch (no bias, no norm, the wrong RoPE pairs) moves the logits by
/// far more. On the K-quant mix the CPU rounds activations to 8 bits (Q8_K, as llama.cpp does)
/// and the device keeps them f32 (its kernels dequantize the weights; `custody_weight` is
/// checked against the CPU's dequantization to 1e-4 in `cuda_kernels`): measured 8.1e-2 on
/// these sharp logits, the size of the difference llama.cpp's own logits showed from
/// f32-activation ones before the CPU had Q8_K kernels; greedy disagreements are allowed only
/// below a margin of 4 × 3e-2 of the largest logit.
#[test]
fn the_device_runs_every_architecture_and_llama_cpps_k_quant_mixes() {
    let mut failures = Vec::new();
    for (file, tol, margin_type) in [
        ("llama-spm.F32", 5e-3, DType::F32),
        ("llama3.F32", 5e-3, DType::F32),
        ("qwen2.F32", 5e-3, DType::F32),
        ("qwen3.F32", 5e-3, DType::F32),
        ("llama-spm.Q4_K_M", 1.2e-1, DType::Q4_K),
        ("llama-spm.Q2_K", 1.2e-1, DType::Q2_K),
    ] {
        let path = custody_tests::fixture(&format!("arch/{file}.gguf"));
        let m = Model::load(&path).expect("load");
        let dev = ShimDevice::new(SEEDS[2]);
        let a = compare_with_cpu(dev, &m, margin_type, 3).expect("compare");
        eprintln!(
            "{file}: max |Δlogit| / max |logit| = {:.2e} (tolerance {tol:.0e}); greedy {}/{} agree, {} clear disagreements",
            a.max_rel_err, a.greedy_agreed, a.greedy_compared, a.clear_disagreements
        );
        if a.max_rel_err > tol || a.clear_disagreements > 0 || a.greedy_compared == 0 {
            failures.push(file);
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// Steps as CUDA graphs: the same steps replayed from captured graphs give the kernel-by-kernel
/// logits bit for bit and the same integrity failures — a prefill batch, decoding steps whose
/// contexts cross pages (so their split layouts change) and whose batch shrinks, a stale
/// segment among them — while each step is one graph launch of the host and graphs are
/// captured once per shape, then replayed. A copy during a capture is refused.
#[test]
fn steps_replayed_from_graphs_are_the_kernel_by_kernel_steps() {
    let m = model(DType::Q8_0, 3);
    let mut pools = [pool(&m), pool(&m)];
    let mut fwd = [
        CudaForward::new(ShimDevice::new(1), &m, &pools[0], 16).expect("upload"),
        CudaForward::new(ShimDevice::new(1), &m, &pools[1], 16).expect("upload"),
    ];
    fwd[1].set_graphs(false).expect("graphs off");
    let seqs: Vec<Seq> = [(1u64, 3usize), (2, 3), (3, 1)]
        .into_iter()
        .map(|(owner, n_pages)| {
            let pages = pools[0].alloc(owner, n_pages).expect("alloc");
            assert_eq!(pools[1].alloc(owner, n_pages).expect("alloc"), pages);
            Seq {
                owner,
                tokens: (0..20).map(|t| (t * 7 + owner as u32) % 64).collect(),
                pages,
            }
        })
        .collect();
    // Step 0: A and B's prompts (6 and 3 rows: padded to 16). Steps 1..=13: A and B decode
    // (positions 6..=18 and 3..=15: their contexts cross pages). Then A alone beside C's
    // stale table (C's page released and reallocated in both pools first).
    let mut steps: Vec<Vec<(usize, usize, usize)>> = vec![vec![(0, 0, 6), (1, 0, 3)]];
    for i in 0..13 {
        steps.push(vec![(0, 6 + i, 7 + i), (1, 3 + i, 4 + i)]);
    }
    let mut graph_steps = 0;
    for (i, step) in steps.iter().enumerate() {
        let segs: Vec<Segment<'_>> = step
            .iter()
            .map(|&(s, from, to)| {
                let mut sg = segment(&seqs[s], from, Logits::All);
                sg.tokens = &seqs[s].tokens[from..to];
                sg
            })
            .collect();
        let [p0, p1] = &mut pools;
        let [f0, f1] = &mut fwd;
        let with = f0.forward(p0, &segs).expect("graph step");
        let without = f1.forward(p1, &segs).expect("kernel-by-kernel step");
        assert_eq!(with.len(), without.len());
        for (a, b) in with.iter().zip(&without) {
            let (a, b) = (a.as_ref().expect("live"), b.as_ref().expect("live"));
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "step {i}: a graph's logits differ from the kernels'"
            );
        }
        graph_steps += 1;
        assert_eq!(
            fwd[0].device_mut().graph_launches(),
            graph_steps,
            "step {i}"
        );
    }
    // The stale segment: C's only page released and taken again by another owner.
    for p in &mut pools {
        p.release(3, &seqs[2].pages).expect("release");
        p.alloc(9, 1).expect("realloc");
    }
    let mut stale = segment(&seqs[2], 0, Logits::Last);
    stale.tokens = &seqs[2].tokens[..4];
    let segs = [segment(&seqs[0], 19, Logits::Last), stale];
    let [p0, p1] = &mut pools;
    let [f0, f1] = &mut fwd;
    let with = f0.forward(p0, &segs).expect("graph step");
    let without = f1.forward(p1, &segs).expect("kernel-by-kernel step");
    assert_eq!(
        with[0].as_ref().expect("A live"),
        without[0].as_ref().expect("A live")
    );
    let e = with[1].as_ref().expect_err("stale");
    assert!(matches!(e, IntegrityError::StaleGeneration { .. }), "{e:?}");
    assert_eq!(Some(e), without[1].as_ref().err());
    // 15 steps, 5 shapes — 16 rows for the prompts; 2 rows at 1, 2 and 4 pages of context
    // (3 pages round up to 4); 8 rows for the last (A's row and C's 4): each captured once
    // and replayed, never captured per step.
    assert_eq!(fwd[0].graphs_held(), 5, "graphs held after 15 steps");
    assert_eq!(fwd[1].graphs_held(), 0);
    assert_eq!(fwd[1].device_mut().graph_launches(), 0);
    // The boundary's rule: no copy while capturing.
    use custody_cuda::{Device, DevicePtr};
    let mut d = ShimDevice::new(0);
    let p: DevicePtr = d.alloc_zeroed(64).expect("alloc");
    d.begin_capture().expect("capture");
    let e = d.upload(p, &[0u8; 8]).expect_err("a copy while capturing");
    assert!(
        e.to_string().contains("while a graph is being captured"),
        "{e}"
    );
    let g = d.end_capture().expect("end");
    d.replay(g).expect("an empty graph replays");
}

/// A prompt longer than a graph's rows (300 > 256) runs kernel by kernel, unpadded, its
/// products through the library GEMM on f16 weights (300 > `GEMV_MAX_ROWS`), its attention
/// through the tensor-core prefill kernel (five tiles of 64 rows a head), and its head
/// computes only the row whose logits are returned (gathered first): the CPU's logits within
/// the tolerance, seven GEMMs a layer and no GEMV but the head's, one gathered row, a head over
/// one row.
#[test]
fn a_long_prompt_runs_kernel_by_kernel_and_its_head_computes_one_row() {
    use custody_cuda::Kernel;
    let m = model(DType::Q8_0, 5);
    let (mut cpu_pool, mut dev_pool) = (pool(&m), pool(&m));
    let mut dev = CudaForward::new(ShimDevice::counting(2), &m, &dev_pool, 320).expect("upload");
    let pages = cpu_pool.alloc(1, 38).expect("alloc");
    assert_eq!(dev_pool.alloc(1, 38).expect("alloc"), pages);
    let s = Seq {
        owner: 1,
        tokens: (0..300).map(|t| (t * 13 % 256) as u32).collect(),
        pages,
    };
    let segs = [segment(&s, 0, Logits::Last)];
    let mut scratch = Scratch::default();
    let cpu = m.forward(&mut cpu_pool, &segs, &mut scratch);
    dev.device_mut().take_counts();
    let gpu = dev.forward(&mut dev_pool, &segs).expect("device forward");
    let (c, g) = (
        cpu[0].as_ref().expect("cpu"),
        gpu[0].as_ref().expect("device"),
    );
    assert_eq!(g.len(), m.config.vocab_size);
    let e = rel_err(c, g);
    eprintln!("300-row prompt: max |Δlogit| / max |logit| = {e:.2e}");
    assert!(e <= tolerance(DType::Q8_0), "rel err {e:.2e}");
    let launches = dev.device_mut().take_counts();
    assert!(
        launches.iter().all(|l| !l.in_graph),
        "300 rows run kernel by kernel"
    );
    assert_eq!(
        dev.device_mut().gemms(),
        7 * m.config.n_layers as u64,
        "Q, K, V, O, gate, up, down by the GEMM"
    );
    let count = |k: Kernel| launches.iter().filter(|l| l.kernel == k).count();
    assert_eq!(
        (count(Kernel::FlashPrefill), count(Kernel::FlashDecode)),
        (m.config.n_layers, 0),
        "the prompt's attention on tensor cores, one launch a layer"
    );
    let gemvs = [Kernel::GemvQ8_0, Kernel::Matvec];
    assert_eq!(
        launches
            .iter()
            .filter(|l| gemvs.contains(&l.kernel))
            .count(),
        1,
        "the head's GEMV only"
    );
    let gather: Vec<_> = launches
        .iter()
        .filter(|l| l.kernel == Kernel::GatherRows)
        .collect();
    assert_eq!(gather.len(), 1);
    assert_eq!(gather[0].dims.grid[0], 1, "one row gathered for the head");
    let head = launches.last().expect("launches");
    assert_eq!(head.kernel, Kernel::GemvQ8_0);
    assert_eq!(head.dims.grid[1], 1, "the head over one row");
    assert_eq!(head.counts.store_bytes, (m.config.vocab_size * 4) as u64);
}

/// A prompt in two chunks of more than a graph's rows (270, then 280 more over the first's
/// K/V): the tensor-core prefill kernel's tiles over a context that starts before them, causal
/// within them, give the CPU's logits within the tolerance, bit for bit alike under every
/// schedule seed (no race between its warps' MMAs, shuffles and staging).
#[test]
fn chunked_prompts_through_the_prefill_kernel_match_the_cpu_under_every_schedule() {
    use custody_cuda::Kernel;
    let m = model(DType::Q4_0, 11);
    let new_pool = |m: &Model| {
        PagePool::new(
            m.page_geometry(PAGE_SIZE, KvType::F16),
            m.config.n_layers,
            80,
        )
    };
    let mut first: Option<Vec<f32>> = None;
    for seed in SEEDS {
        let (mut cpu_pool, mut dev_pool) = (new_pool(&m), new_pool(&m));
        let mut dev =
            CudaForward::new(ShimDevice::counting(seed), &m, &dev_pool, 320).expect("upload");
        let pages = cpu_pool.alloc(1, 70).expect("alloc");
        assert_eq!(dev_pool.alloc(1, 70).expect("alloc"), pages);
        let s = Seq {
            owner: 1,
            tokens: (0..550).map(|t| (t * 29 % 256) as u32).collect(),
            pages,
        };
        let mut scratch = Scratch::default();
        let mut logits = Vec::new();
        for (start, end) in [(0, 270), (270, 550)] {
            let chunk = Seq {
                owner: s.owner,
                tokens: s.tokens[..end].to_vec(),
                pages: s.pages.clone(),
            };
            let segs = [segment(&chunk, start, Logits::Last)];
            let cpu = m.forward(&mut cpu_pool, &segs, &mut scratch);
            let gpu = dev.forward(&mut dev_pool, &segs).expect("device forward");
            let (c, g) = (
                cpu[0].as_ref().expect("cpu"),
                gpu[0].as_ref().expect("device"),
            );
            let e = rel_err(c, g);
            eprintln!("seed {seed:#x}, rows {start}..{end}: max |Δlogit| / max |logit| = {e:.2e}");
            assert!(e <= tolerance(DType::Q4_0), "rows {start}..{end}: {e:.2e}");
            logits.extend_from_slice(g);
        }
        let prefill = launched(dev.device_mut(), Kernel::FlashPrefill);
        assert_eq!(
            prefill,
            2 * m.config.n_layers,
            "both chunks on tensor cores"
        );
        match &first {
            None => first = Some(logits),
            Some(f) => assert!(
                f.iter()
                    .zip(&logits)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "logits differ between schedule seeds (a race)"
            ),
        }
    }
}

/// Q4_K products on int8 activations (`cuda_check::run_int8_workload`): on a Q4_K model whose
/// widths are whole Q4_K blocks, a 21-row prompt step of three sequences (on integer tensor
/// cores, `custody_mmq_q4k*`) and a 3-row decode step (dp4a GEMVs) give the CPU's logits within
/// `INT8_CPU_TOL` — as the same steps on f32 x do — and the f32-x run's within the Q4_K
/// tolerance (`int8_passes`), bit for bit alike under every schedule seed; those steps launch
/// only int8-x products (fused for Q/K/V and gate/up+SwiGLU as the f32-x GEMVs are), one
/// quantize launch a layer (before down: the norms and flash decoding's merge quantize what
/// they write), and a single-row step keeps f32 x.
#[test]
fn decode_batches_multiply_q4k_weights_by_int8_activations_and_match_the_cpu() {
    use custody_cuda::Kernel;
    use custody_runtime::cuda_check::{int8_model, int8_passes, int8_pool, run_int8_workload};
    let m = custody_runtime::cuda_check::load(&int8_model()).expect("synthetic model");
    let layers = m.config.n_layers;
    let q8_kernels = [
        Kernel::GemvQ4KQ8Qkv,
        Kernel::GemvQ4KQ8Swiglu,
        Kernel::GemvQ4KQ8,
        Kernel::MmqQ4KQkv,
        Kernel::MmqQ4KSwiglu,
        Kernel::MmqQ4K,
        Kernel::QuantizeQ8,
    ];
    let tensor_cores = [Kernel::MmqQ4KQkv, Kernel::MmqQ4KSwiglu, Kernel::MmqQ4K];
    let f32_kernels = [Kernel::GemvQ4KQkv, Kernel::GemvQ4KSwiglu, Kernel::GemvQ4K];
    let mut first: Option<Vec<f32>> = None;
    for seed in SEEDS {
        let mut runs = Vec::new();
        for dp4a in [true, false] {
            let mut fwd = CudaForward::new(ShimDevice::counting(seed), &m, &int8_pool(&m), 32)
                .expect("upload");
            fwd.set_dp4a(dp4a).expect("switch");
            fwd.device_mut().take_counts();
            let run = run_int8_workload(&mut fwd, &m, |step, fwd| {
                let launches = fwd.device_mut().take_counts();
                let count =
                    |ks: &[Kernel]| launches.iter().filter(|l| ks.contains(&l.kernel)).count();
                // Steps 0 and 1 have 3 rows or more; step 0's 21 (a 32-row graph) on tensor
                // cores.
                let int8 = dp4a && step < 2;
                let what = format!("seed {seed:#x}, dp4a {dp4a}, step {step}");
                assert_eq!(
                    count(&q8_kernels),
                    if int8 { 5 * layers + 1 } else { 0 },
                    "{what}: int8-x launches"
                );
                assert_eq!(
                    count(&tensor_cores),
                    if int8 && step == 0 { 4 * layers + 1 } else { 0 },
                    "{what}: tensor-core products"
                );
                assert_eq!(
                    count(&f32_kernels),
                    if int8 { 0 } else { 4 * layers + 1 },
                    "{what}: f32-x launches"
                );
            })
            .expect("workload");
            eprintln!(
                "seed {seed:#x}, dp4a {dp4a}: max |Δlogit| / max |logit| per step {:?}",
                run.rel_err
            );
            runs.push(run);
        }
        let (int8, f32_run) = (&runs[0], &runs[1]);
        assert!(int8_passes(int8, f32_run), "seed {seed:#x}: {runs:?}");
        match &first {
            None => first = Some(int8.device_logits.clone()),
            Some(f) => assert!(
                f.iter()
                    .zip(&int8.device_logits)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "seed {seed:#x}: logits differ between schedule seeds (a race)"
            ),
        }
    }
}

/// How many of the counted launches since the last take ran `kernel` (and forget them).
fn launched(dev: &mut ShimDevice, kernel: custody_cuda::Kernel) -> usize {
    dev.take_counts()
        .iter()
        .filter(|l| l.kernel == kernel)
        .count()
}
