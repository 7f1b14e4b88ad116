//! The pair's peer checkpoint exchange: each node keeps the other's newest signed checkpoints in
//! its own log, a place the other node's disk cannot rewrite — so a cut tail of one node's log
//! (its newest digest and the files it names deleted) shows when the root is verified, from the
//! other node's sealed `node_events` (`docs/audit-schema.md`, *Checkpoint*).
//!
//! Prefill drives it: every interval it sends its own newest checkpoint over the control plane
//! (`Decode.ExchangeCheckpoints`); decode keeps it and answers with its own, which prefill keeps.
//! What a node keeps is not trusted: `custody audit verify` checks every checkpoint against its
//! node's key. A node refuses checkpoints that claim to be its own.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use custody_audit::AuditSink;
use custody_audit::checkpoint::{Checkpoint, Keeper, Latest};
use tonic::Status;
use tonic::transport::Channel;

use crate::proto::{self, decode_client::DecodeClient};

/// Most checkpoints one exchange carries (a node sends its own newest).
pub const EXCHANGE_MAX_CHECKPOINTS: usize = 4;
/// Most bytes of one checkpoint's JSON (one is about 500 B).
pub const CHECKPOINT_MAX_BYTES: usize = 4096;

/// What a node needs to take part: its own newest checkpoint and where the peer's go.
#[derive(Clone, Debug)]
pub struct PeerCheckpoints {
    /// This node's newest checkpoint (a sink of its own writer).
    pub own: Arc<Latest>,
    /// This node's log: the peer's checkpoints are recorded here.
    pub log: Arc<dyn AuditSink>,
    /// How often prefill exchanges (its writer's checkpoint interval).
    pub interval: Duration,
}

/// One node's side of the exchange.
#[derive(Debug)]
pub(crate) struct Exchange {
    own: Arc<Latest>,
    keeper: Mutex<Keeper>,
    own_node: u32,
}

impl Exchange {
    /// `peer` names the other node's role (in errors).
    pub(crate) fn new(p: &PeerCheckpoints, own_node: u32, peer: &str) -> Self {
        Self {
            own: p.own.clone(),
            keeper: Mutex::new(Keeper::new(p.log.clone(), format!("{peer} checkpoints"))),
            own_node,
        }
    }

    /// This node's newest checkpoint, to send (none before the writer issued one).
    pub(crate) fn own_message(&self) -> proto::Checkpoints {
        proto::Checkpoints {
            checkpoints: self.own.get().map(|cp| cp.to_json()).into_iter().collect(),
        }
    }

    /// Keep what the peer sent; returns how many were new. Blocking: the log's bounded queue
    /// may make the recording wait.
    pub(crate) fn keep(&self, sent: &proto::Checkpoints) -> Result<usize, Status> {
        if sent.checkpoints.len() > EXCHANGE_MAX_CHECKPOINTS {
            return Err(Status::invalid_argument(format!(
                "{} checkpoints in one exchange (at most {EXCHANGE_MAX_CHECKPOINTS})",
                sent.checkpoints.len()
            )));
        }
        let mut kept = 0;
        for text in &sent.checkpoints {
            let cp = self.parse(text)?;
            let mut keeper = self.keeper.lock().unwrap_or_else(|p| p.into_inner());
            let new = keeper
                .keep(&cp)
                .map_err(|e| Status::unavailable(e.to_string()))?;
            kept += usize::from(new);
        }
        Ok(kept)
    }

    fn parse(&self, text: &str) -> Result<Checkpoint, Status> {
        if text.len() > CHECKPOINT_MAX_BYTES {
            return Err(Status::invalid_argument(format!(
                "a checkpoint of {} bytes (at most {CHECKPOINT_MAX_BYTES})",
                text.len()
            )));
        }
        let cp = Checkpoint::parse(text).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if cp.body.node == self.own_node {
            return Err(Status::invalid_argument(format!(
                "a checkpoint of node {} is this node's own: a peer cannot speak for it",
                cp.body.node
            )));
        }
        Ok(cp)
    }
}

/// Prefill's side: exchange every `interval` until the node is gone (`alive` dropped). A failed
/// exchange is logged and retried at the next interval (the checkpoints' absence is what a
/// verifier sees).
pub(crate) async fn exchange_loop(
    mut decode: DecodeClient<Channel>,
    ex: Arc<Exchange>,
    interval: Duration,
    alive: std::sync::Weak<()>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if alive.upgrade().is_none() {
            return;
        }
        let reply = match decode.exchange_checkpoints(ex.own_message()).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                tracing::warn!(error = %s.message(), "checkpoint exchange with decode failed");
                continue;
            }
        };
        let ex = ex.clone();
        match tokio::task::spawn_blocking(move || ex.keep(&reply)).await {
            Ok(Ok(n)) => tracing::debug!(kept = n, "decode's checkpoints kept"),
            Ok(Err(s)) => tracing::warn!(error = %s.message(), "decode's checkpoints not kept"),
            Err(e) => tracing::warn!(error = %e, "decode's checkpoints not kept"),
        }
    }
}
