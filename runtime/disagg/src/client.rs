//! Serving the two roles, a blocking client of the front door, and an in-process pair (both
//! roles in one process, talking real gRPC and the real KV transport over loopback) for tests.

use crate::transport::Discard;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_stream::StreamExt;
use tonic::Status;
use tonic::transport::{Channel, Server};

use super::decode::{DecodeHandle, DecodeOptions};
use super::fleet::{FleetNode, FleetService};
use super::prefill::{PrefillHandle, PrefillOptions, PrefillStartError};
use super::proto::{self, prefill_client::PrefillClient};
use crate::engine::{Engine, GenerateRequest};
use crate::tls::{Fleet, NodeIdentity, Role, Security};

/// Serve the decode node's control plane on `listener` until `shutdown` fires: over mutual TLS
/// admitting only the prefill identities `security` accepts, or plaintext on loopback.
pub async fn serve_decode(
    h: DecodeHandle,
    listener: tokio::net::TcpListener,
    security: Security,
    shutdown: oneshot::Receiver<()>,
) -> Result<(), ServeError> {
    // The load report, to its router (a front identity) only.
    let fleet = proto::fleet_server::FleetServer::with_interceptor(
        FleetService::new(FleetNode::Decode(Box::new(h.clone()))),
        security.interceptor(&[Role::Front]),
    );
    let svc = proto::decode_server::DecodeServer::with_interceptor(
        h.service(),
        security.interceptor(&[Role::Prefill]),
    );
    serve_secured(
        Server::builder().add_service(svc).add_service(fleet),
        listener,
        &security,
        shutdown,
    )
    .await
}

/// Serve the prefill node's front door on `listener` until `shutdown` fires: over mutual TLS
/// admitting only the front identities `security` accepts, or plaintext on loopback.
pub async fn serve_prefill(
    h: PrefillHandle,
    listener: tokio::net::TcpListener,
    security: Security,
    shutdown: oneshot::Receiver<()>,
) -> Result<(), ServeError> {
    // The load report, to its router (a front identity) only.
    let fleet = proto::fleet_server::FleetServer::with_interceptor(
        FleetService::new(FleetNode::Prefill(Box::new(h.clone()))),
        security.interceptor(&[Role::Front]),
    );
    let svc = proto::prefill_server::PrefillServer::with_interceptor(
        h.service(),
        security.interceptor(&[Role::Front]),
    );
    serve_secured(
        Server::builder().add_service(svc).add_service(fleet),
        listener,
        &security,
        shutdown,
    )
    .await
}

/// Run `router` on `listener`: TLS streams from this process's own acceptor
/// ([`crate::tls::NodeTls::incoming`]), or plain TCP on loopback.
async fn serve_secured(
    router: tonic::transport::server::Router,
    listener: tokio::net::TcpListener,
    security: &Security,
    shutdown: oneshot::Receiver<()>,
) -> Result<(), ServeError> {
    security.check_addr(listener.local_addr()?)?;
    let stop = async {
        // Sent or dropped, the sender's end means stop: both are the signal.
        shutdown
            .await
            .discard("a dropped shutdown sender stops the server too");
    };
    match security {
        Security::Tls(t) => {
            router
                .serve_with_incoming_shutdown(t.incoming(listener), stop)
                .await?
        }
        Security::InsecureLoopback => {
            router
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop,
                )
                .await?
        }
    }
    Ok(())
}

/// Why a node's gRPC service stopped or did not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Grpc(#[from] tonic::transport::Error),
}

/// One finished generation as the client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub finish_reason: String,
    pub prompt_tokens: u32,
    /// Time to the first token, as the client measured it.
    pub ttft: Duration,
    pub total: Duration,
    /// The prefill node's request id (its audit log's `request_id`).
    pub request: u64,
    /// Prompt tokens the prefill node took from its prefix cache.
    pub cached_tokens: u32,
}

/// Collect a front-door token stream.
pub async fn collect(
    client: &mut PrefillClient<Channel>,
    req: &GenerateRequest,
) -> Result<Generated, Status> {
    let t0 = Instant::now();
    let mut stream = client
        .generate(proto::GenerateRequest {
            tenant: req.tenant.clone(),
            prompt: req.prompt.clone(),
            max_tokens: req.max_tokens as u32,
            sampling: Some(super::sampling_to_proto(&req.sampling)),
            stop_ids: req.stop_ids.clone(),
            cache_salt: String::new(),
            route: None,
            decoding: Some(super::decoding_to_proto(&req.decoding)),
        })
        .await?
        .into_inner();
    let mut out = Generated {
        tokens: Vec::new(),
        finish_reason: String::new(),
        prompt_tokens: req.prompt.len() as u32,
        ttft: Duration::ZERO,
        total: Duration::ZERO,
        request: 0,
        cached_tokens: 0,
    };
    while let Some(ev) = stream.next().await {
        let ev = ev?;
        if !ev.error.is_empty() {
            return Err(Status::aborted(ev.error));
        }
        if out.tokens.is_empty() {
            // The first event: who answers, and what its prefix cache gave.
            out.request = ev.request;
            out.cached_tokens = ev.cached_tokens;
        }
        if ev.finish_reason.is_empty() {
            if out.tokens.is_empty() {
                out.ttft = t0.elapsed();
            }
            out.tokens.push(ev.token);
        } else {
            if ev.generated_tokens as usize > out.tokens.len() {
                // A request that ended at its first token carries it in the final event.
                if out.tokens.is_empty() {
                    out.ttft = t0.elapsed();
                }
                out.tokens.push(ev.token);
            }
            out.finish_reason = ev.finish_reason;
            out.total = t0.elapsed();
            return Ok(out);
        }
    }
    Err(Status::unavailable(
        "the token stream ended without a finish",
    ))
}

/// Options of an in-process pair.
#[derive(Clone, Debug)]
pub struct PairOptions {
    pub prefill: PrefillOptions,
    pub decode: DecodeOptions,
    /// The fleet whose certificates the pair and its client get (prefill, decode, and the
    /// pair's own client as front 0); `None`: plaintext on loopback.
    pub fleet: Option<std::sync::Arc<Fleet>>,
    /// TLS on the KV transport (needs `fleet`); sets both nodes' `kv_encryption`.
    pub transport_encryption: bool,
}

/// The identity of the in-process pair's own client (a front).
pub const PAIR_FRONT: NodeIdentity = NodeIdentity {
    role: Role::Front,
    node: 0,
};

/// Each role's security in an in-process pair: certificates from `fleet` naming the options'
/// node ids, each accepting the others.
fn pair_security(
    fleet: Option<&Fleet>,
    prefill: u32,
    decode: u32,
) -> Result<(Security, Security, Security), crate::tls::TlsError> {
    let Some(f) = fleet else {
        return Ok((
            Security::InsecureLoopback,
            Security::InsecureLoopback,
            Security::InsecureLoopback,
        ));
    };
    let (p, d) = (
        NodeIdentity::new(Role::Prefill, prefill),
        NodeIdentity::new(Role::Decode, decode),
    );
    Ok((
        Security::Tls(f.node_tls(p, vec![d, PAIR_FRONT])?),
        Security::Tls(f.node_tls(d, vec![p])?),
        Security::Tls(f.node_tls(PAIR_FRONT, vec![p])?),
    ))
}

/// Both roles in one process, over real gRPC and the real tcp KV transport on loopback.
#[derive(Debug)]
pub struct Pair {
    rt: tokio::runtime::Runtime,
    pub decode: DecodeHandle,
    pub prefill: PrefillHandle,
    pub prefill_addr: SocketAddr,
    pub decode_addr: SocketAddr,
    /// Each server's security (its certificate, what it admits, the handshakes it refused).
    pub prefill_security: Security,
    pub decode_security: Security,
    client: PrefillClient<Channel>,
    stops: Vec<oneshot::Sender<()>>,
}

/// Why an in-process pair could not start.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    #[error(transparent)]
    Prefill(#[from] PrefillStartError),
    #[error(transparent)]
    Grpc(#[from] tonic::transport::Error),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Channel(#[from] crate::tls::ChannelError),
}

impl Pair {
    pub fn start(
        prefill: Engine,
        decode: Engine,
        mut opts: PairOptions,
    ) -> Result<Self, PairError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (psec, dsec, fsec) = pair_security(
            opts.fleet.as_deref(),
            opts.prefill.node_id,
            opts.decode.node_id,
        )?;
        if opts.transport_encryption {
            opts.decode.kv_encryption = dsec.kv_encryption(Role::Decode, true)?;
            opts.prefill.kv_encryption = psec.kv_encryption(Role::Prefill, true)?;
        }
        let dh = DecodeHandle::start(decode, opts.decode)?;
        let (dl, pl) = rt.block_on(async {
            let d = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let p = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            Ok::<_, std::io::Error>((d, p))
        })?;
        let (decode_addr, prefill_addr) = (dl.local_addr()?, pl.local_addr()?);
        let (dstop, drx) = oneshot::channel();
        let served = serve_decode(dh.clone(), dl, dsec.clone(), drx);
        rt.spawn(async move {
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the pair's decode control plane stopped");
            }
        });
        let ph = rt.block_on(PrefillHandle::start(
            prefill,
            opts.prefill,
            &psec,
            &format!("http://{decode_addr}"),
        ))?;
        let (pstop, prx) = oneshot::channel();
        let served = serve_prefill(ph.clone(), pl, psec.clone(), prx);
        rt.spawn(async move {
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the pair's front door stopped");
            }
        });
        let channel =
            rt.block_on(fsec.channel(&format!("http://{prefill_addr}"), Role::Prefill))?;
        let client = PrefillClient::new(channel);
        Ok(Self {
            rt,
            decode: dh,
            prefill: ph,
            prefill_addr,
            decode_addr,
            prefill_security: psec,
            decode_security: dsec,
            client,
            stops: vec![dstop, pstop],
        })
    }

    /// One generation through the front door (blocking).
    pub fn generate(&self, req: &GenerateRequest) -> Result<Generated, Status> {
        let mut c = self.client.clone();
        self.rt.block_on(collect(&mut c, req))
    }

    /// Several generations concurrently through the front door (blocking).
    pub fn generate_many(&self, reqs: &[GenerateRequest]) -> Vec<Result<Generated, Status>> {
        let tasks: Vec<_> = reqs
            .iter()
            .map(|r| {
                let mut c = self.client.clone();
                let r = r.clone();
                self.rt.spawn(async move { collect(&mut c, &r).await })
            })
            .collect();
        self.rt.block_on(async {
            let mut out = Vec::new();
            for t in tasks {
                out.push(
                    t.await
                        .unwrap_or_else(|e| Err(Status::internal(e.to_string()))),
                );
            }
            out
        })
    }

    /// Run a future on the pair's runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    pub fn client(&self) -> PrefillClient<Channel> {
        self.client.clone()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for s in self.stops.drain(..) {
            s.send(())
                .discard("the server task already stopped: nothing to signal");
        }
    }
}
