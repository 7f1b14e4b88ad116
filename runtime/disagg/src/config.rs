//! `[disagg]`: the disaggregated pair's addresses and transfer options (plain data; the binary
//! deserialises it from the node's TOML file).

use serde::Deserialize;

use crate::kv::ReleaseFill;

/// The disaggregated pair (`custody prefill` / `custody decode`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggSection {
    /// Decode: gRPC control-plane listen address. Prefill: the decode node's control address.
    pub decode_control: String,
    /// Decode: KV transport (tcp) listen address; advertised to prefill in the handshake.
    pub decode_transport: String,
    /// KV transport of both nodes: "tcp" (software, everywhere) or "verbs" (RDMA; needs a build
    /// with `--features rdma` and a device). Both nodes must agree (the handshake checks).
    pub transport: String,
    /// With `transport = "verbs"`: the device (e.g. "mlx5_0"); empty = the first one.
    pub verbs_device: String,
    /// Prefill: gRPC front-door listen address (clients submit generations here).
    pub prefill_listen: String,
    /// Verify a checksum of every transferred page before marking it written.
    pub checksum: bool,
    /// What released pages are overwritten with: "none", "zero" or "canary".
    pub release_fill: ReleaseFill,
    /// TLS on the tcp KV transport's connections (needs `[tls]` certificates; both nodes must
    /// agree). Off, every connection still proves its pairing's secret before any frame.
    pub transport_encryption: bool,
    /// Prefill in a fleet: every decode node it writes into (`[[disagg.decode]]`), each verified
    /// by its own identity. Empty: the one at `decode_control`, named by `[tls] accept`.
    pub decode: Vec<DecodePeer>,
    /// Both roles: where `/health/live` and `/health/ready` answer (plain HTTP; empty = off).
    pub health_listen: String,
    /// Both roles: on SIGTERM the node drains — refuses new requests, finishes those running —
    /// and exits when none is left or after this long, whichever comes first.
    pub drain_timeout_ms: u64,
}

/// One decode node a prefill node writes into.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DecodePeer {
    /// Its node id: its certificate must say `custody-node:decode:<node>`.
    pub node: u32,
    /// Its control plane, `host:port`.
    pub control: String,
}

impl Default for DisaggSection {
    fn default() -> Self {
        Self {
            decode_control: "127.0.0.1:7071".into(),
            decode_transport: "127.0.0.1:7072".into(),
            transport: "tcp".into(),
            verbs_device: String::new(),
            prefill_listen: "127.0.0.1:7070".into(),
            checksum: true,
            release_fill: ReleaseFill::None,
            transport_encryption: false,
            decode: Vec::new(),
            health_listen: String::new(),
            drain_timeout_ms: 30_000,
        }
    }
}

/// `[tls]`: how this process authenticates to the fleet and whom it deals with (`tls.rs`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    /// The fleet's CA certificate (PEM): peers' certificates must be signed by it.
    pub ca: Option<std::path::PathBuf>,
    /// This process's certificate (PEM; its URI SAN `custody-node:<role>:<node>` is who it is).
    pub cert: Option<std::path::PathBuf>,
    /// This process's private key (PEM).
    pub key: Option<std::path::PathBuf>,
    /// The identities this process deals with: those it admits as callers (decode: its prefill
    /// nodes; prefill: its fronts) and those it connects to (prefill: its decode node; a front:
    /// its prefill node), e.g. `["custody-node:prefill:1"]`.
    pub accept: Vec<String>,
    /// Plaintext instead of mutual TLS: only loopback addresses are then allowed, and the node
    /// records it in `node_events` at start. For a single-machine test only.
    pub insecure_loopback: bool,
}
