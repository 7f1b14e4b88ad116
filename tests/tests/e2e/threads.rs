//! The compute pool returns the same bits whatever its size: every output element is computed by
//! the same kernel code whichever part of a section it falls in (`custody_kernels::par`).

use custody_kernels::attention::{PageRef, Reader, ReduceOrder, TagCheck};
use custody_runtime::Model;
use custody_runtime::kv::PagePool;
use custody_runtime::model::{Logits, Scratch, Segment};
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

/// Every logit of a prefill of `ids` (all rows) and of `steps` greedy decode steps after it.
fn logits_of(model: &Model, ids: &[u32], steps: usize) -> Vec<f32> {
    const PAGE: usize = 16;
    let c = &model.config;
    let n_pages = (ids.len() + steps).div_ceil(PAGE);
    let mut pool = PagePool::new(model.page_geometry(PAGE), c.n_layers, n_pages);
    let table = pool.alloc(7, n_pages).expect("pages");
    let mut s = Scratch::default();
    fn seg<'a>(
        tokens: &'a [u32],
        start_pos: usize,
        block_table: &'a [PageRef],
        logits: Logits,
        order: ReduceOrder,
    ) -> Segment<'a> {
        Segment {
            tokens,
            start_pos,
            block_table,
            reader: Reader::private(7),
            logits,
            order,
            check: TagCheck::Enforced,
        }
    }
    let mut all = model
        .forward(
            &mut pool,
            &[seg(ids, 0, &table, Logits::All, ReduceOrder::Gemm)],
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
                    Logits::Last,
                    ReduceOrder::Vec,
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
