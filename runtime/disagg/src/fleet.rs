//! The `Fleet` service every node serves to its router: the load report, which is also the
//! router's active health probe (a node that cannot answer it is not routed to).

use tonic::{Request, Response, Status};

use super::decode::DecodeHandle;
use super::prefill::PrefillHandle;
use super::proto::{self, fleet_server};

/// The node a [`FleetService`] reports on.
#[derive(Clone, Debug)]
pub enum FleetNode {
    /// Boxed: the handles carry their handshake statements (hundreds of bytes).
    Prefill(Box<PrefillHandle>),
    Decode(Box<DecodeHandle>),
}

/// The `Fleet` gRPC service.
#[derive(Clone, Debug)]
pub struct FleetService {
    node: FleetNode,
}

impl FleetService {
    pub fn new(node: FleetNode) -> Self {
        Self { node }
    }
}

impl FleetNode {
    /// This node's report now; `Unavailable` when its engine thread does not answer.
    pub async fn report(&self) -> Result<proto::LoadReport, Status> {
        let stopped = || Status::unavailable("engine stopped");
        Ok(match self {
            FleetNode::Prefill(h) => {
                let st = h.stats().await.ok_or_else(stopped)?;
                let mut r = base(&h.info, h.draining());
                r.pool_pages = st.pool_pages as u64;
                r.free_pages = st.free_pages as u64;
                r.live_requests = st.live_requests as u32;
                r.cached_pages = st.cached_pages as u64;
                r.decode_peers = h
                    .peer_links()
                    .into_iter()
                    .filter(|l| l.node != 0)
                    .map(|l| proto::PeerLink {
                        node_id: l.node,
                        epoch: l.epoch,
                        connected: l.connected,
                    })
                    .collect();
                r
            }
            FleetNode::Decode(h) => {
                let st = h.stats().await.ok_or_else(stopped)?;
                let mut r = base(&h.info, h.draining());
                r.pool_pages = st.pool_pages as u64;
                r.free_pages = st.free_pages as u64;
                r.live_requests = (st.live_requests + st.reservations) as u32;
                r
            }
        })
    }

    /// Whether the node takes new requests (for `/health/ready`): not draining, and — prefill —
    /// paired with at least one decode node. Blocking (the health thread's).
    pub fn ready_blocking(&self) -> Result<(), String> {
        match self {
            FleetNode::Prefill(h) => {
                if h.draining() {
                    return Err("draining".into());
                }
                if !h.peer_links().iter().any(|l| l.connected) {
                    return Err("no decode node is paired".into());
                }
                h.stats_blocking()
                    .map(|_| ())
                    .ok_or_else(|| "engine stopped".into())
            }
            FleetNode::Decode(h) => {
                if h.draining() {
                    return Err("draining".into());
                }
                h.stats_blocking()
                    .map(|_| ())
                    .ok_or_else(|| "engine stopped".into())
            }
        }
    }

    /// Requests the node still holds (a draining node exits when this reaches 0). Blocking.
    pub fn live_blocking(&self) -> Option<usize> {
        match self {
            FleetNode::Prefill(h) => h.stats_blocking().map(|s| s.live_requests),
            FleetNode::Decode(h) => h.stats_blocking().map(|s| s.live_requests + s.reservations),
        }
    }
}

fn base(info: &proto::NodeInfo, draining: bool) -> proto::LoadReport {
    proto::LoadReport {
        node_id: info.node_id,
        role: info.role.clone(),
        epoch: info.epoch,
        model_fingerprint: info.model_fingerprint.clone(),
        page_size: info.page_size,
        context_length: info.context_length,
        draining,
        kv_dtype: info.kv_dtype.clone(),
        n_layers: info.n_layers,
        kv_dim: info.kv_dim,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl fleet_server::Fleet for FleetService {
    async fn load(
        &self,
        _r: Request<proto::LoadRequest>,
    ) -> Result<Response<proto::LoadReport>, Status> {
        self.node.report().await.map(Response::new)
    }
}
