//! Safety property 1 ("no stale read") end to end: the attention kernel's tag check fails the one
//! request whose pages are wrong, emits no token for it, and lets the others finish.

use custody_kernels::attention::{
    self, AttnScratch, IntegrityError, PageGeometry, PageRef, Reader, ReduceOrder,
};
use custody_runtime::SamplingParams;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::kv::{AttendRead, PagePool};
use proptest::prelude::*;

use crate::{engine_with, small_cfg, tokenizer};

fn req(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: "tenant-a".into(),
        cache: None,
    }
}

/// Run two requests; after both have decoded a few tokens apply `fault(victim, other)`, then run
/// to the end. Returns (events of the victim after the fault, tokens of the other, error).
fn run_with_fault(
    fault: impl FnOnce(&mut custody_runtime::engine::FaultInjector<'_>, u64, u64),
) -> (usize, usize, IntegrityError) {
    let tok = tokenizer();
    let mut e = engine_with(small_cfg());
    // 40 prompt tokens + 40 generated: 5 pages of 16 each.
    let p1 = tok
        .encode(
            &"The quick brown fox jumps over the lazy dog. ".repeat(4),
            true,
        )
        .expect("enc");
    let p2 = tok
        .encode(&"Pack my box with five dozen liquor jugs. ".repeat(4), true)
        .expect("enc");
    let victim = e.submit(req(p1, 40)).expect("admit");
    let other = e.submit(req(p2, 40)).expect("admit");
    for _ in 0..3 {
        e.step();
    }
    fault(&mut e.fault_injection(), victim, other);
    let (mut victim_tokens, mut other_tokens, mut err) = (0, 0, None);
    while e.has_work() {
        for ev in e.step() {
            match ev {
                Event::Token { id, .. } if id == victim => victim_tokens += 1,
                Event::Token { id, .. } if id == other => other_tokens += 1,
                Event::Failed { id, error } => {
                    assert_eq!(id, victim, "only the victim fails");
                    assert!(err.is_none(), "failed once");
                    err = Some(error);
                }
                _ => {}
            }
        }
    }
    (
        victim_tokens,
        other_tokens,
        err.expect("the victim must fail with an integrity error"),
    )
}

#[test]
fn stale_page_fails_the_request_and_emits_no_token() {
    let (vt, ot, err) = run_with_fault(|f, victim, _| f.reallocate_page(victim, 0));
    assert!(
        matches!(err, IntegrityError::StaleGeneration { .. }),
        "{err}"
    );
    assert_eq!(vt, 0, "no token after the fault");
    assert_eq!(ot, 40 - 3, "the other request finishes");
}

#[test]
fn foreign_page_fails_the_request_and_emits_no_token() {
    let (vt, ot, err) =
        run_with_fault(|f, victim, other| f.point_at_foreign_page(victim, 1, other));
    assert!(matches!(err, IntegrityError::ForeignOwner { .. }), "{err}");
    assert_eq!((vt, ot), (0, 37));
}

#[test]
fn unwritten_slot_fails_the_request_and_emits_no_token() {
    // Skip the request to the start of its next page: the write there succeeds (slot 0 of a fresh
    // page), but attention would read the skipped, never-written slots of the current page — the
    // kernel's read-side check refuses.
    let (vt, ot, err) = run_with_fault(|f, victim, _| {
        let pos = f.position(victim);
        f.skip_positions(victim, 16 - pos % 16);
    });
    assert!(matches!(err, IntegrityError::UnwrittenSlot { .. }), "{err}");
    assert_eq!((vt, ot), (0, 37));
}

// ---- property test: random alloc / write / free / read sequences on the real pool + kernel.

const G: PageGeometry = PageGeometry {
    page_size: 4,
    n_kv_heads: 1,
    head_dim: 8,
    kv: custody_kernels::attention::KvType::F16,
};

/// [`G`] with rows of one q8_0 block.
const G_Q8: PageGeometry = PageGeometry {
    head_dim: 32,
    kv: custody_kernels::attention::KvType::Q8_0,
    ..G
};

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        pages: usize,
    },
    Write {
        seq: usize,
        n: usize,
    },
    Free {
        seq: usize,
    },
    Read {
        seq: usize,
        n_ctx_extra: usize,
    },
    /// Read through a block table retained from a freed sequence (a stale reader).
    ReadStale {
        seq: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..4).prop_map(|pages| Op::Alloc { pages }),
        (0usize..8, 1usize..6).prop_map(|(seq, n)| Op::Write { seq, n }),
        (0usize..8).prop_map(|seq| Op::Free { seq }),
        (0usize..8, 0usize..3).prop_map(|(seq, n_ctx_extra)| Op::Read { seq, n_ctx_extra }),
        (0usize..8).prop_map(|seq| Op::ReadStale { seq }),
    ]
}

struct SeqState {
    owner: u64,
    pages: Vec<PageRef>,
    written: usize,
    live: bool,
}

/// The value written at slot `t` by `owner`: unique per (owner, position), exact in f16.
fn marker(owner: u64, t: usize) -> f32 {
    (owner * 64 + t as u64) as f32
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn tag_check_never_lets_a_reader_see_a_slot_not_written_for_it(ops in prop::collection::vec(op(), 1..60)) {
        // The same operations on an f16 and a q8_0 pool: the check does not depend on how a
        // page's bytes are stored.
        for g in [G, G_Q8] {
            let mut pool = PagePool::new(g, 1, 6);
            let mut seqs: Vec<SeqState> = Vec::new();
            let mut next_owner = 1u64;
            let mut scratch = AttnScratch::default();
            for op in ops.iter().cloned() {
                match op {
                    Op::Alloc { pages } => {
                        if let Ok(p) = pool.alloc(next_owner, pages) {
                            seqs.push(SeqState { owner: next_owner, pages: p, written: 0, live: true });
                        }
                        next_owner += 1;
                    }
                    Op::Write { seq, n } => {
                        let Some(s) = seqs.get_mut(seq) else { continue };
                        for _ in 0..n {
                            let t = s.written;
                            let Some(&pr) = s.pages.get(t / g.page_size) else { break };
                            let row = vec![marker(s.owner, t); g.n_kv_heads * g.head_dim];
                            let r = pool.write_slot(0, pr, t % g.page_size, s.owner, &row, &row);
                            prop_assert_eq!(r.is_ok(), s.live, "writes succeed exactly for live owners");
                            if r.is_err() { break }
                            s.written += 1;
                        }
                    }
                    Op::Free { seq } => {
                        let Some(s) = seqs.get_mut(seq) else { continue };
                        if s.live {
                            pool.release(s.owner, &s.pages).expect("release own pages");
                            s.live = false;
                        }
                    }
                    Op::Read { seq, .. } | Op::ReadStale { seq } if seq < seqs.len() => {
                        let extra = if let Op::Read { n_ctx_extra, .. } = op { n_ctx_extra } else { 0 };
                        let s = &seqs[seq];
                        let n_ctx = s.written + extra;
                        if n_ctx == 0 { continue }
                        // A single query at position n_ctx - 1 attends slots 0..n_ctx. Uniform query:
                        // the output is the mean of the attended V rows if every row is this owner's.
                        let q = vec![0.0f32; g.head_dim];
                        // The pool's one read path, with the pool's own tags and memory.
                        let read = AttendRead {
                            q: &q, n_heads: 1, start_pos: n_ctx - 1,
                            block_table: &s.pages, reader: Reader::private(s.owner),
                            order: ReduceOrder::Vec, check: attention::TagCheck::Enforced,
                        };
                        let mut out = vec![0.0f32; g.head_dim];
                        match pool.attend(0, &read, &mut out, &mut scratch) {
                            Ok(()) => {
                                // The check passed: the reader must be live and every slot written by it.
                                prop_assert!(s.live, "a freed sequence read its old pages");
                                prop_assert!(n_ctx <= s.written, "read of unwritten slots passed the check");
                                let want = (0..n_ctx).map(|t| marker(s.owner, t)).sum::<f32>() / n_ctx as f32;
                                prop_assert!((out[0] - want).abs() <= want.abs() * 2e-3 + 1e-3,
                                    "read {} but this owner wrote values averaging {}", out[0], want);
                            }
                            Err(_) => prop_assert!(!s.live || n_ctx > s.written, "a legitimate read was refused"),
                        }
                    }
                    Op::Read { .. } | Op::ReadStale { .. } => {}
                }
            }
        }
    }
}
