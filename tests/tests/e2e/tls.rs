//! Nobody joins the fleet uninvited: every gRPC channel of a pair is mutual TLS with real
//! certificates (`custody_runtime::disagg::tls`), and each way in without the right one is
//! refused with a clear error — another CA's certificate, an expired one, none, the wrong role,
//! a handshake that states another node id than its certificate's, a front door call from
//! anything but an accepted front. The tenant a front asserts is recorded with its identity.

use std::time::Duration;

use custody_audit::Event as AEv;
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::client::PAIR_FRONT;
use custody_runtime::disagg::proto::{
    self, decode_client::DecodeClient, prefill_client::PrefillClient,
};
use custody_runtime::disagg::tls::{Fleet, NodeIdentity, NodeTls, Role, Security, Validity};
use custody_runtime::disagg::tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::disagg::{Nodes, fleet, start_pair};

const PREFILL: NodeIdentity = NodeIdentity {
    role: Role::Prefill,
    node: 1,
};
const DECODE: NodeIdentity = NodeIdentity {
    role: Role::Decode,
    node: 2,
};

fn pair() -> Nodes {
    start_pair(
        crate::small_cfg(),
        crate::small_cfg(),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
    )
}

/// A channel to `addr` presenting `tls` (verifying the server as `peer`).
async fn channel(tls: NodeTls, addr: std::net::SocketAddr, peer: Role) -> Result<Channel, String> {
    Security::Tls(tls)
        .channel(&format!("http://{addr}"), peer)
        .await
        .map_err(|e| format!("{e:?}"))
}

/// What calling decode's `Handshake` as `tls` gets: the node info, or why not.
fn decode_handshake(nodes: &Nodes, tls: NodeTls, stated_node: u32) -> Result<(), String> {
    let addr = nodes.pair.decode_addr;
    nodes.pair.block_on(async move {
        let ch = channel(tls, addr, Role::Decode).await?;
        let mut c = DecodeClient::new(ch);
        let mut hello = nodes.pair.prefill.info.clone();
        hello.node_id = stated_node;
        c.handshake(hello)
            .await
            .map(|_| ())
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    })
}

#[test]
fn every_way_in_without_the_right_certificate_is_refused() {
    let nodes = pair();
    let ours = fleet();
    let theirs = Fleet::new("another fleet", 2).expect("CA");

    // The pair's own prefill identity is admitted (a repeated handshake is a reconnect).
    let good = ours.node_tls(PREFILL, vec![DECODE]).expect("tls");
    decode_handshake(&nodes, good.clone(), PREFILL.node).expect("the paired prefill node");

    // Its certificate, but another node id in the handshake.
    let e = decode_handshake(&nodes, good, 5).expect_err("node id differs from the certificate");
    assert!(
        e.contains("PermissionDenied") && e.contains("states node 5"),
        "{e}"
    );

    // A certificate naming the right identity from another CA (the client trusts ours for the
    // server, so the refusal is the server's).
    let other = theirs
        .issue(PREFILL, &[], Validity::Days(1))
        .expect("issue");
    let other = NodeTls::from_pem(ours.ca_pem(), &other.cert_pem, &other.key_pem, vec![DECODE])
        .expect("tls");
    let refused = || match &nodes.pair.decode_security {
        Security::Tls(t) => t.refused_handshakes(),
        Security::InsecureLoopback => panic!("the suite's pairs run mutual TLS"),
    };
    // Each refused attempt adds at least one refused handshake (a client may retry once).
    // The server counts a refusal when its handshake task ends, which may be just after the
    // client saw the alert.
    // The count once a previous attempt's retries are over (stable for 200 ms; at most 10 s).
    let settled = || {
        for _ in 0..50 {
            let a = refused();
            std::thread::sleep(Duration::from_millis(200));
            if refused() == a {
                return a;
            }
        }
        panic!("decode's refused-handshake count never settled");
    };
    let refused_to = |n: u64| {
        let t0 = std::time::Instant::now();
        while refused() < n && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        refused()
    };
    let mark = settled();
    decode_handshake(&nodes, other, 1).expect_err("another CA");
    assert!(
        refused_to(mark + 1) > mark,
        "decode refused the TLS handshake (and logged why)"
    );

    // The fleet's CA, the wrong role.
    let front = ours.node_tls(PAIR_FRONT, vec![DECODE]).expect("tls");
    let e = decode_handshake(&nodes, front, 0).expect_err("a front is not a prefill node");
    assert!(
        e.contains("PermissionDenied") && e.contains("custody-node:front:0 is not accepted"),
        "{e}"
    );

    // An expired certificate from the fleet's CA.
    let expired = ours.issue(PREFILL, &[], Validity::Expired).expect("issue");
    let expired = NodeTls::from_pem(
        ours.ca_pem(),
        &expired.cert_pem,
        &expired.key_pem,
        vec![DECODE],
    )
    .expect("tls");
    let mark = settled();
    decode_handshake(&nodes, expired, 1).expect_err("expired");
    assert!(
        refused_to(mark + 1) > mark,
        "an expired certificate is refused in the handshake"
    );

    // No client certificate at all (TLS that verifies the server only).
    let addr = nodes.pair.decode_addr;
    let ca = ours.ca_pem().to_owned();
    let mark = settled();
    let e = nodes.pair.block_on(async move {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name(DECODE.dns_name());
        let ch = Endpoint::from_shared(format!("https://{addr}"))
            .expect("uri")
            .tls_config(tls)
            .expect("tls")
            .connect()
            .await;
        match ch {
            Err(e) => format!("connect: {e}"),
            Ok(ch) => DecodeClient::new(ch)
                .abort(proto::AbortRequest {
                    request: 1,
                    ..Default::default()
                })
                .await
                .map(|_| "Ok".to_owned())
                .unwrap_or_else(|s| format!("{:?}: {}", s.code(), s.message())),
        }
    });
    assert_ne!(e, "Ok", "a client without a certificate was served");
    assert!(
        refused_to(mark + 1) > mark,
        "no client certificate: refused in the handshake"
    );

    // Plaintext against a TLS node is not gRPC to it.
    let mark = settled();
    let e = nodes.pair.block_on(async move {
        let ch = Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        DecodeClient::new(ch)
            .abort(proto::AbortRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| s.message().to_owned())
    });
    assert!(e.is_err(), "plaintext was served");
    assert!(
        refused_to(mark + 1) > mark,
        "plaintext is not a TLS handshake"
    );
}

fn generate_as(nodes: &Nodes, tls: NodeTls, tenant: &str) -> Result<u64, String> {
    let addr = nodes.pair.prefill_addr;
    let tenant = tenant.to_owned();
    nodes.pair.block_on(async move {
        let ch = channel(tls, addr, Role::Prefill).await?;
        let mut c = PrefillClient::new(ch);
        let mut s = c
            .generate(proto::GenerateRequest {
                decoding: None,
                tenant,
                prompt: vec![1, 504, 3458, 282],
                max_tokens: 2,
                sampling: None,
                stop_ids: vec![],
                cache_salt: String::new(),
                route: None,
            })
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        let first = s
            .message()
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
            .ok_or("no event")?;
        while s
            .message()
            .await
            .map_err(|s| s.message().to_owned())?
            .is_some()
        {}
        Ok(first.request)
    })
}

#[test]
fn only_an_accepted_front_asserts_a_tenant_and_its_identity_is_recorded() {
    let nodes = pair();
    let ours = fleet();
    // A prefill certificate (not a front), a front the node does not accept.
    for who in [
        PREFILL,
        NodeIdentity {
            role: Role::Front,
            node: 7,
        },
    ] {
        let tls = ours.node_tls(who, vec![PREFILL]).expect("tls");
        let e = generate_as(&nodes, tls, "victim").expect_err("not an accepted front");
        assert!(e.contains("PermissionDenied"), "{who}: {e}");
    }
    // The accepted front: served, and the tenant it asserted is recorded with its identity.
    let tls = ours.node_tls(PAIR_FRONT, vec![PREFILL]).expect("tls");
    let id = generate_as(&nodes, tls, "acme").expect("served");
    let events = nodes.prefill_audit.events.lock().expect("events").clone();
    let recorded = events.iter().any(|e| {
        matches!(e, AEv::Node { kind, detail, .. }
            if &**kind == custody_runtime::disagg::prefill::FRONT_REQUEST_EVENT
                && *detail == format!("request={id} tenant=acme front={PAIR_FRONT}"))
    });
    assert!(
        recorded,
        "no front_request row for request {id}: {events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, AEv::Request { tenant, .. } if &**tenant == "victim")),
        "a refused caller's tenant reached the log"
    );
}
