//! The compute pool returns the same bits whatever its size: every output element is computed by
//! the same kernel code whichever part of a section it falls in (`custody_kernels::par`).

use custody_kernels::attention::{KvType, PageRef, Reader, ReduceOrder, TagCheck};
use custody_runtime::Model;
use custody_runtime::kv::PagePool;
use custody_runtime::model::{Logits, Rows, Scratch, Segment};
use custody_runtime::par::ThreadPool;
use custody_tests::fixture;

/// The benchmark prompt's first `n` ids.
fn prompt(n: usize) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llamacpp-smollm2/bench_prompt.json")).expect("fixture"),
    )
    .expect("json");
    v["all_ids"].as_array().expect("ids")[..n]
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// A segment of owner `owner`'s rows: a prompt's (`Rows::Prompt`) as llama.cpp multiplies them
/// (`ReduceOrder::Gemm`), a decode token's one at a time.
fn seg<'a>(
    tokens: &'a [u32],
    start_pos: usize,
    table: &'a [PageRef],
    owner: u64,
    logits: Logits,
    rows: Rows,
) -> Segment<'a> {
    Segment {
        tokens,
        start_pos,
        block_table: table,
        reader: Reader::private(owner),
        logits,
        order: match rows {
            Rows::Prompt { .. } => ReduceOrder::Gemm,
            Rows::Decode => ReduceOrder::Vec,
        },
        rows,
        check: TagCheck::Enforced,
    }
}

/// A whole prompt of `len` tokens computed in one batch.
fn prompt_rows(len: usize) -> Rows {
    Rows::Prompt { len, chunk: len }
}

/// Every logit of a prefill of `ids` (all rows) and of `steps` greedy decode steps after it.
fn logits_of(model: &Model, ids: &[u32], steps: usize) -> Vec<f32> {
    const PAGE: usize = 16;
    let c = &model.config;
    let n_pages = (ids.len() + steps).div_ceil(PAGE);
    let mut pool = PagePool::new(model.page_geometry(PAGE, KvType::F16), c.n_layers, n_pages);
    let table = pool.alloc(7, n_pages).expect("pages");
    let mut s = Scratch::default();
    let mut all = model
        .forward(
            &mut pool,
            &[seg(ids, 0, &table, 7, Logits::All, prompt_rows(ids.len()))],
            &mut s,
        )
        .remove(0)
        .expect("prefill passes the tag check");
    let vocab = c.vocab_size;
    for step in 0..steps {
        let last = &all[all.len() - vocab..];
        let next = [custody_kernels::ops::argmax(last).expect("logits") as u32];
        let row = model
            .forward(
                &mut pool,
                &[seg(
                    &next,
                    ids.len() + step,
                    &table,
                    7,
                    Logits::Last,
                    Rows::Decode,
                )],
                &mut s,
            )
            .remove(0)
            .expect("decode passes the tag check");
        all.extend_from_slice(&row);
    }
    all
}

#[test]
fn one_two_and_three_threads_give_the_same_logits() {
    // 470 prompt tokens: prefill (activations quantized in parallel, matmuls, 470 × 9 attention
    // items) and decode over ≥ 456 slots (the size from which decode attention is split too).
    let model = Model::load(&custody_tests::model_path()).expect("model");
    let ids = prompt(470);
    let runs: Vec<(usize, Vec<f32>)> = [1, 2, 3]
        .into_iter()
        .map(|threads| {
            let pool = ThreadPool::new(threads).expect("pool");
            (threads, pool.install(|| logits_of(&model, &ids, 6)))
        })
        .collect();
    let one = &runs[0].1;
    assert_eq!(one.len(), (470 + 6) * model.config.vocab_size);
    for (threads, logits) in &runs[1..] {
        let differing = logits
            .iter()
            .zip(one)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "{threads} threads: {differing} logits differ in their bits"
        );
    }
}

/// A K-quant prompt row keeps its bits however the engine splits the prompt across steps (a
/// prefix-cache hit, a chunk cut short by other requests' rows) and whatever shares its step:
/// its float order follows the batch llama.cpp would compute it in (`model::Rows`), not the
/// step's. A tiny Llama 3 in llama.cpp's Q4_K_M (Q4_K: its repacked GEMM/GEMV orders; Q6_K: its
/// tiled path).
#[test]
fn a_k_quant_prompt_row_keeps_its_bits_however_the_prompt_is_split() {
    const PAGE: usize = 16;
    let model = Model::load(&fixture("arch/llama3.Q4_K_M.gguf")).expect("model");
    let c = &model.config;
    let ids: Vec<u32> = (0..40u32)
        .map(|i| (i * 37 + 11) % c.vocab_size as u32)
        .collect();
    let other: Vec<u32> = vec![5, 9, 13, 2, 7];
    let prompt = Rows::Prompt {
        len: ids.len(),
        chunk: 512,
    };
    let (ids, other) = (&ids[..], &other[..]);
    let run = |split: Option<Rows>| {
        let mut pool = PagePool::new(model.page_geometry(PAGE, KvType::F16), c.n_layers, 8);
        let (a, b) = (
            pool.alloc(7, 3).expect("pages"),
            pool.alloc(8, 1).expect("pages"),
        );
        let mut s = Scratch::default();
        match split {
            None => model.forward(
                &mut pool,
                &[seg(ids, 0, &a, 7, Logits::All, prompt)],
                &mut s,
            ),
            Some(rest) => {
                let first = seg(&ids[..13], 0, &a, 7, Logits::None, prompt);
                assert!(model.forward(&mut pool, &[first], &mut s)[0].is_ok());
                let other = seg(
                    other,
                    0,
                    &b,
                    8,
                    Logits::Last,
                    Rows::Prompt { len: 5, chunk: 512 },
                );
                let rest = seg(&ids[13..], 13, &a, 7, Logits::All, rest);
                model.forward(&mut pool, &[other, rest], &mut s)
            }
        }
        .pop()
        .expect("a result")
        .expect("passes the tag check")
    };
    let vocab = c.vocab_size;
    let whole = run(None);
    let split = run(Some(prompt));
    let differing = |v: &[f32]| {
        v.iter()
            .zip(&whole[13 * vocab..])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count()
    };
    assert_eq!(split.len(), whole.len() - 13 * vocab);
    assert_eq!(
        differing(&split),
        0,
        "rows 13.. of the prompt, computed after a 13-row first step beside another request"
    );
    // The comparison can fail: the same rows in other batches (chunks of 6: Q4_K's GEMV for
    // rows 4 and 5 of each, Q6_K's `vec_dot`) differ.
    let other_batches = run(Some(Rows::Prompt {
        len: ids.len(),
        chunk: 6,
    }));
    assert!(differing(&other_batches) > 0);
}
