//! The KV transport lets in only its paired prefill node: a tcp connection must prove the
//! pairing's secret (issued over the mutual-TLS control plane) before a single frame is read, and
//! a region's key (random, never reused) lands writes only from its own pairing's connections.
//! Checked from outside with a raw TCP client that knows the wire format and a live key exactly,
//! against the decode pool's raw memory (the test oracle), and with TLS on the transport.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use custody_runtime::disagg::proto;

use crate::disagg::{Nodes, req, start_pair, start_pair_encrypted};

/// A layer whose K bytes the oracle compares (any layer is written by a transfer).
const ORACLE_LAYER: usize = 7;

/// One write frame as the tcp transport's wire format defines it (`transport::tcp` docs):
/// `magic "KVWR" | opcode | wr_id | remote_addr | rkey | imm | flags | len | payload`.
fn raw_write_frame(rkey: u32, remote_addr: u64, payload: &[u8]) -> Vec<u8> {
    const MAGIC_WR: u32 = 0x4b56_5752;
    const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
    const SEND_SIGNALED: u32 = 2;
    let mut f = Vec::with_capacity(40 + payload.len());
    for w in [MAGIC_WR, WR_RDMA_WRITE_WITH_IMM] {
        f.extend_from_slice(&w.to_le_bytes());
    }
    f.extend_from_slice(&1u64.to_le_bytes());
    f.extend_from_slice(&remote_addr.to_le_bytes());
    for w in [rkey, 0, SEND_SIGNALED, payload.len() as u32] {
        f.extend_from_slice(&w.to_le_bytes());
    }
    f.extend_from_slice(payload);
    f
}

/// A live reservation on the pair's decode node, made as its prefill node would.
fn reserve(nodes: &Nodes) -> proto::ReserveReply {
    let addr = nodes.pair.decode_addr;
    nodes
        .pair
        .block_on(async move {
            let mut c = crate::disagg::decode_client(addr).await;
            c.reserve(proto::ReserveRequest {
                decoding: None,
                origin_request: 4242,
                origin_node: 1,
                tenant: "victim".into(),
                prompt: (0..40).map(|i| 300 + i).collect(),
                max_tokens: 4,
                sampling: None,
                stop_ids: vec![],
                route: None,
            })
            .await
        })
        .expect("reserved")
        .into_inner()
}

fn refused(nodes: &Nodes) -> u64 {
    let st = nodes.pair.decode.stats_blocking().expect("stats");
    st.transport.refused_connections
}

fn wait_refused(nodes: &Nodes, at_least: u64) {
    let t0 = Instant::now();
    while refused(nodes) < at_least {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "refusals never counted: {:?}",
            nodes.pair.decode.stats_blocking()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The target closed the raw connection: EOF or reset, never an acknowledgement.
fn assert_disconnected(mut raw: TcpStream) {
    raw.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut buf = [0u8; 256];
    let mut got = 0usize;
    loop {
        match raw.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    // A TLS target answers a non-TLS hello with at most an alert; a plain one says nothing.
    assert!(
        got <= 7,
        "the target answered {got} bytes to an unauthenticated client"
    );
}

/// Raw TCP clients send a well-formed write of a whole page with the live reservation's exact
/// key and base (stolen), and one with a guessed key: nothing lands, both are disconnected and
/// counted, and the pair goes on serving.
fn raw_writers_land_nothing(nodes: &Nodes) {
    let r = reserve(nodes);
    let pages: Vec<u32> = r.pages.iter().map(|p| p.page).collect();
    let before = nodes
        .pair
        .decode
        .inspect_k_blocking(ORACLE_LAYER, pages.clone())
        .expect("oracle");
    let landed0 = nodes.pair.decode.stats_blocking().expect("stats").transport;
    let refused0 = landed0.refused_connections;
    let kv: SocketAddr = nodes.pair.decode.transport_addr.parse().expect("kv addr");
    let page = vec![0x5Au8; r.page_stride as usize];
    let mut raws = Vec::new();
    for (rkey, base) in [(r.rkey, r.base), (r.rkey ^ 0x1234_5678, r.base ^ (7 << 32))] {
        let mut raw = TcpStream::connect(kv).expect("connect");
        // The target may close before the whole page is sent: a failed write is fine.
        let _ = raw.write_all(&raw_write_frame(rkey, base, &page));
        raws.push(raw);
    }
    wait_refused(nodes, refused0 + 2);
    for raw in raws {
        assert_disconnected(raw);
    }
    let after = nodes
        .pair
        .decode
        .inspect_k_blocking(ORACLE_LAYER, pages)
        .expect("oracle");
    assert_eq!(before, after, "the decode pool's memory changed");
    let st = nodes.pair.decode.stats_blocking().expect("stats").transport;
    assert_eq!(
        (st.landed_writes, st.landed_bytes),
        (landed0.landed_writes, landed0.landed_bytes),
        "a write landed"
    );
    // The paired prefill node is untouched: the pair serves.
    let g = nodes
        .pair
        .generate(&req("acme", vec![1, 504, 3458, 282], 4))
        .expect("still serving");
    assert_eq!(g.tokens.len(), 4);
}

#[test]
fn a_raw_tcp_client_with_a_stolen_key_lands_nothing_and_is_disconnected() {
    let nodes = start_pair(
        crate::small_cfg(),
        crate::small_cfg(),
        Default::default(),
        Duration::from_secs(30),
    );
    raw_writers_land_nothing(&nodes);
}

#[test]
fn an_encrypted_transport_serves_the_same_tokens_and_refuses_raw_writers() {
    let prompt = vec![1, 504, 3458, 282, 1500, 314];
    let mut colo = crate::engine_with(crate::small_cfg());
    let want = crate::reference::greedy(&mut colo, prompt.clone(), 8);
    let nodes = start_pair_encrypted(crate::small_cfg(), crate::small_cfg());
    assert!(nodes.pair.decode.info.transport_encryption);
    let got = nodes
        .pair
        .generate(&req("acme", prompt, 8))
        .expect("served over TLS");
    assert_eq!(
        got.tokens, want,
        "the encrypted pair's greedy output differs"
    );
    raw_writers_land_nothing(&nodes);
}

/// A write for a reservation the decode node no longer holds (its lease expired while it sat
/// idle) is still read, refused and acknowledged: its sender gets a completion, not silence —
/// an idle decode node keeps reading its transport.
#[test]
fn a_write_after_the_lease_expired_is_refused_even_when_decode_is_idle() {
    use custody_runtime::transport::KvTransport;
    use custody_runtime::transport::abi::{SendWr, Sge, wc_status};
    use custody_runtime::transport::tcp::TcpTransport;
    let nodes = start_pair(
        crate::small_cfg(),
        crate::small_cfg(),
        Default::default(),
        Duration::from_millis(300),
    );
    // Pair as prefill node 1 would (a fresh handshake: its own pairing), then reserve.
    let addr = nodes.pair.decode_addr;
    let hello = nodes.pair.prefill.info.clone();
    let reply = nodes
        .pair
        .block_on(async move {
            let mut c = crate::disagg::decode_client(addr).await;
            c.handshake(hello).await
        })
        .expect("handshake")
        .into_inner();
    let pairing = custody_runtime::disagg::pairing_of(&reply).expect("pairing");
    let mut init = TcpTransport::new(9);
    init.connect(reply.transport_addr.parse().expect("addr"), &pairing)
        .expect("authenticated connection");
    let r = reserve(&nodes);
    // The lease expires and the node has nothing left to do.
    std::thread::sleep(Duration::from_millis(1500));
    let data = [1u8; 64];
    let sge = [Sge {
        addr: data.as_ptr() as u64,
        length: 64,
        lkey: 0,
    }];
    let wr = SendWr::rdma_write(7, &sge, r.base, r.rkey).with_imm(0);
    // SAFETY: `data` outlives the completion polled below.
    unsafe { init.post_write(&wr) }.expect("post");
    let t0 = Instant::now();
    let mut wcs = Vec::new();
    while wcs.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no completion: an idle decode node did not read its transport"
        );
        init.poll_send(&mut wcs, 8).expect("poll");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(wcs[0].status, wc_status::REM_ACCESS_ERR, "{:?}", wcs[0]);
}
