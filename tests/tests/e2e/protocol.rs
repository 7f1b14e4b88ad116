//! An illegal protocol transition fails the request on each node — cleanly (a clear client
//! error naming the transition, the `requests` row `failed` with it as the reason, pages back
//! once no write can land) — and is never ignored; the node goes on serving.

use std::time::{Duration, Instant};

use custody_audit::{Event as AEv, MemorySink, RequestKind};
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::prefill::PrefillFault;
use custody_runtime::disagg::proto;
use custody_runtime::disagg::protocol::ReqEvent;

use crate::disagg::{Nodes, cfg, req, start_pair};

/// The `failed` reason of request `id` in `sink`, if it has one.
fn failed_reason(sink: &MemorySink, id: u64) -> Option<String> {
    sink.events
        .lock()
        .expect("lock")
        .iter()
        .find_map(|e| match e {
            AEv::Request {
                request,
                kind: RequestKind::Failed { reason },
                ..
            } if *request == id => Some(reason.clone()),
            _ => None,
        })
}

/// Waits (bounded) until the decode node holds no request and every page is free again.
fn assert_decode_pool_whole(nodes: &Nodes) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = nodes.pair.decode.stats_blocking().expect("decode stats");
        if st.free_pages == st.pool_pages && st.reservations == 0 && st.quarantined_pages == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "decode pool not whole again: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn still_serves(nodes: &Nodes) {
    let g = nodes
        .pair
        .generate(&req("acme", vec![1, 504, 3458, 282], 4))
        .expect("the node goes on serving after the failed request");
    assert_eq!(g.tokens.len(), 4);
}

/// Decode: a `Commit` for a reservation none of whose pages landed asks for `Reserved` on
/// `Handoff`, an edge the protocol does not have. The request fails (not merely the call), its
/// key is invalidated and its pages come back.
#[test]
fn decode_fails_the_request_on_an_illegal_transition() {
    let nodes = start_pair(
        cfg(1024, 32),
        cfg(1024, 32),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
    );
    let addr = nodes.pair.decode_addr;
    let (reserved, commit) = nodes.pair.block_on(async {
        let mut c = crate::disagg::decode_client(addr).await;
        let reserved = c
            .reserve(proto::ReserveRequest {
                decoding: None,
                origin_request: 77,
                origin_node: 1,
                tenant: "acme".into(),
                prompt: vec![1, 504, 3458, 282, 1500],
                max_tokens: 8,
                sampling: None,
                stop_ids: vec![],
                route: None,
            })
            .await
            .expect("reserve")
            .into_inner();
        let commit = c
            .commit(proto::CommitRequest {
                request: reserved.request,
                first_token: 42,
            })
            .await;
        (reserved, commit)
    });
    let status = commit.expect_err("a commit before any page landed is illegal");
    assert_eq!(
        status.code(),
        custody_runtime::disagg::tonic::Code::FailedPrecondition,
        "{status:?}"
    );
    assert!(
        status
            .message()
            .contains("illegal protocol transition: Reserved on Handoff"),
        "{status:?}"
    );
    let reason = failed_reason(&nodes.decode_audit, reserved.request)
        .expect("the decode node records the request as failed");
    assert!(reason.contains("Reserved on Handoff"), "{reason}");
    assert_decode_pool_whole(&nodes);
    still_serves(&nodes);
}

/// Prefill: a protocol bug (injected) applies `Handoff` while the request is `Prefilling`. The
/// machine refuses it; the client gets a clear error naming the transition, the prefill
/// node's `requests` row says `failed` with it, decode's reservation is aborted and its pages
/// come back; the next request is served.
#[test]
fn prefill_fails_the_request_on_an_illegal_transition() {
    let nodes = start_pair(
        cfg(1024, 32),
        cfg(1024, 32),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
    );
    nodes
        .pair
        .prefill
        .fault_inject(PrefillFault::ProtocolEvent(ReqEvent::Handoff));
    let err = nodes
        .pair
        .generate(&req("acme", vec![1, 504, 3458, 282, 1500, 30], 6))
        .expect_err("the request with the illegal transition fails");
    assert!(
        err.message()
            .contains("illegal protocol transition: Prefilling on Handoff"),
        "{err:?}"
    );
    let failed: Vec<String> = nodes
        .prefill_audit
        .events
        .lock()
        .expect("lock")
        .iter()
        .filter_map(|e| match e {
            AEv::Request {
                kind: RequestKind::Failed { reason },
                ..
            } => Some(reason.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].contains("Prefilling on Handoff"), "{failed:?}");
    assert_decode_pool_whole(&nodes);
    let st = nodes.pair.prefill.stats_blocking().expect("prefill stats");
    assert_eq!(st.free_pages, st.pool_pages, "{st:?}");
    still_serves(&nodes);
}
