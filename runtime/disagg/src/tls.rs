//! Mutual TLS between the fleet's processes, and who is on the other end of a channel.
//!
//! Every process holds a key and a certificate from the fleet's CA. The certificate's URI SAN
//! names the process's role and node id (`custody-node:decode:2`, [`NodeIdentity`]); its DNS SAN
//! (`decode-2.custody`) is what a client verifies the server by. A server requires a client
//! certificate from the same CA — the TLS handshake refuses anything else: another CA's, an
//! expired one, none — and then admits only the identities it is configured to accept
//! ([`Security::admit`]). A caller's identity is what its certificate says, never a field it
//! sends: decode checks the handshake's node id against it, prefill records the front that
//! asserted each request's tenant.
//!
//! Plaintext only with an explicit `[tls] insecure_loopback = true`, which refuses every
//! address but loopback ([`Security::check_addr`]).

use crate::transport::Discard;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tonic::transport::{Certificate, ClientTlsConfig, Identity};
use tonic::{Request, Status};

use crate::config::TlsSection;
use crate::transport::KvEncryption;

/// What a process is in the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Prefill,
    Decode,
    /// An HTTP server in front of a pair: the only role that may assert a tenant.
    Front,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Front => "front",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            "front" => Some(Role::Front),
            _ => None,
        }
    }
}

/// Who a certificate says its holder is: a role and a node id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeIdentity {
    pub role: Role,
    pub node: u32,
}

/// The URI scheme of a node identity SAN.
pub const IDENTITY_SCHEME: &str = "custody-node";

impl NodeIdentity {
    pub fn new(role: Role, node: u32) -> Self {
        Self { role, node }
    }

    /// `custody-node:<role>:<node>`, the certificate's URI SAN.
    pub fn uri(&self) -> String {
        format!("{IDENTITY_SCHEME}:{}:{}", self.role.name(), self.node)
    }

    /// `<role>-<node>.custody`, the DNS SAN a client verifies the server by.
    pub fn dns_name(&self) -> String {
        format!("{}-{}.custody", self.role.name(), self.node)
    }

    /// Parse `custody-node:<role>:<node>`.
    pub fn parse(s: &str) -> Result<Self, TlsError> {
        let bad = || TlsError::Identity(s.to_owned());
        let rest = s
            .strip_prefix(IDENTITY_SCHEME)
            .and_then(|r| r.strip_prefix(':'))
            .ok_or_else(bad)?;
        let (role, node) = rest.split_once(':').ok_or_else(bad)?;
        Ok(Self {
            role: Role::parse(role).ok_or_else(bad)?,
            node: node.parse().map_err(|_| bad())?,
        })
    }

    /// The identity a DER certificate names: its one `custody-node:` URI SAN.
    pub fn of_certificate(der: &[u8]) -> Result<Self, TlsError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| TlsError::Certificate(e.to_string()))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| TlsError::Certificate(e.to_string()))?
            .ok_or(TlsError::NoIdentity)?;
        let mut found = san.value.general_names.iter().filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u)
                if u.starts_with(&format!("{IDENTITY_SCHEME}:")) =>
            {
                Some(*u)
            }
            _ => None,
        });
        let (Some(one), None) = (found.next(), found.next()) else {
            return Err(TlsError::NoIdentity);
        };
        Self::parse(one)
    }
}

impl std::fmt::Display for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

/// Why a process's TLS material or a peer is refused.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{0:?} is not a node identity (want custody-node:<prefill|decode|front>:<node id>)")]
    Identity(String),
    #[error("certificate: {0}")]
    Certificate(String),
    #[error(
        "the certificate names no node identity (one URI SAN custody-node:<role>:<node>; make one with `custody certs`)"
    )]
    NoIdentity,
    #[error("[tls] {0}")]
    Config(String),
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "[tls] insecure_loopback = true allows only loopback addresses, not {0} (configure [tls] ca, cert and key)"
    )]
    NotLoopback(String),
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// A process's TLS material, checked: the CA, its own identity and certificate, and the
/// identities it deals with (those it admits as callers, and those it connects to).
#[derive(Clone)]
pub struct NodeTls {
    ca: Certificate,
    identity: Identity,
    own: NodeIdentity,
    accept: Arc<Vec<NodeIdentity>>,
    /// This process's server side (its own acceptor: each refused handshake logged, counted).
    server: Arc<rustls::ServerConfig>,
    /// The KV transport's TLS (`[disagg] transport_encryption`): server and client sides.
    kv_server: Arc<rustls::ServerConfig>,
    kv_client: Arc<rustls::ClientConfig>,
    refused: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls")
            .field("own", &self.own)
            .field("accept", &self.accept)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    /// From PEM text: the CA certificate, this process's certificate and key, the identities
    /// it deals with. The certificate must name one node identity.
    pub fn from_pem(
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
        accept: Vec<NodeIdentity>,
    ) -> Result<Self, TlsError> {
        let der = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
            .map_err(|e| TlsError::Certificate(e.to_string()))?
            .1
            .contents;
        let own = NodeIdentity::of_certificate(&der)?;
        Ok(Self {
            ca: Certificate::from_pem(ca_pem),
            identity: Identity::from_pem(cert_pem, key_pem),
            own,
            accept: Arc::new(accept),
            server: Arc::new(server_config(
                ca_pem,
                cert_pem,
                key_pem,
                ALPN_GRPC,
                Arc::new(rustls::crypto::ring::default_provider()),
                rustls::DEFAULT_VERSIONS,
            )?),
            kv_server: Arc::new(kv_server_config(ca_pem, cert_pem, key_pem)?),
            kv_client: Arc::new(client_config(ca_pem, cert_pem, key_pem, ALPN_KV)?),
            refused: Arc::default(),
        })
    }

    /// TLS handshakes this process's servers refused (another CA, expired, no certificate, …).
    pub fn refused_handshakes(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Accept TLS on `listener`'s connections, each handshake on its own task: the accepted
    /// streams (for tonic's `serve_with_incoming`; the client's certificate travels with each),
    /// the refused ones logged with the peer and the reason, and counted. Bounded: at most
    /// [`TLS_PENDING_ACCEPTED`] accepted streams wait for the server.
    pub fn incoming(
        &self,
        listener: tokio::net::TcpListener,
    ) -> tokio_stream::wrappers::ReceiverStream<
        Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>,
    > {
        let (tx, rx) = tokio::sync::mpsc::channel(TLS_PENDING_ACCEPTED);
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        let refused = self.refused.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = tokio::select! {
                    r = listener.accept() => match r {
                        Ok(c) => c,
                        Err(e) => {
                            // Out of descriptors, say: back off rather than spin.
                            tracing::warn!(error = %e, "accepting a connection failed");
                            tokio::time::sleep(ACCEPT_RETRY_PAUSE).await;
                            continue;
                        }
                    },
                    () = tx.closed() => return,
                };
                let (acceptor, tx, refused) = (acceptor.clone(), tx.clone(), refused.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            tx.send(Ok(tls)).await.discard(
                                "the listener stopped accepting: the server is shutting down",
                            );
                        }
                        // Closed before saying anything (a reachability probe): not a refusal.
                        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                            tracing::debug!(%peer, "connection closed before a TLS handshake");
                        }
                        Ok(Err(e)) => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            tracing::warn!(%peer, reason = %e, "TLS handshake refused");
                        }
                        Err(_) => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            tracing::warn!(%peer, "TLS handshake refused: timed out");
                        }
                    }
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    /// This process's identity (from its certificate).
    pub fn own(&self) -> NodeIdentity {
        self.own
    }

    /// The identity of `role` this process deals with (the first in `accept`).
    pub fn peer(&self, role: Role) -> Result<NodeIdentity, TlsError> {
        self.accept
            .iter()
            .copied()
            .find(|i| i.role == role)
            .ok_or_else(|| {
                TlsError::Config(format!(
                    "accept lists no {} identity (e.g. \"custody-node:{}:<node>\")",
                    role.name(),
                    role.name()
                ))
            })
    }

    /// The KV transport's TLS as its target (decode): client certificates required, from the
    /// CA. (Which peer may write is the pairing's business; TLS adds secrecy and integrity.)
    pub fn kv_server(&self) -> KvEncryption {
        KvEncryption::Server(self.kv_server.clone())
    }

    /// The KV transport's TLS as an initiator (prefill) writing to `peer`: its certificate
    /// must be the CA's and name `peer`'s DNS name; this process presents its own.
    pub fn kv_client(&self, peer: NodeIdentity) -> Result<KvEncryption, TlsError> {
        let server_name = rustls::pki_types::ServerName::try_from(peer.dns_name())
            .map_err(|e| TlsError::Config(format!("{peer}: {e}")))?;
        Ok(KvEncryption::Client {
            config: self.kv_client.clone(),
            server_name,
        })
    }

    /// Client side, talking to `peer`: its certificate must be the CA's and name `peer`'s DNS
    /// name; this process presents its own.
    pub fn client(&self, peer: NodeIdentity) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
            .domain_name(peer.dns_name())
    }
}

/// Accepted TLS streams that may wait for the gRPC server.
pub const TLS_PENDING_ACCEPTED: usize = 64;
/// How long the acceptor pauses after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);
/// How long a TLS handshake may take before the connection is dropped.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

const ALPN_GRPC: &[u8] = b"h2";
/// The KV transport's application protocol (a gRPC client cannot be confused with it).
const ALPN_KV: &[u8] = b"custody-kv/1";

/// The KV transport's server side: as [`server_config`], TLS 1.3 only, its own ALPN, and no
/// session tickets (a connection lives as long as its pairing; nothing to resume).
fn kv_server_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<rustls::ServerConfig, TlsError> {
    let mut cfg = server_config(
        ca_pem,
        cert_pem,
        key_pem,
        ALPN_KV,
        kv_provider(),
        &[&rustls::version::TLS13],
    )?;
    cfg.send_tls13_tickets = 0;
    Ok(cfg)
}

fn roots(ca_pem: &str) -> Result<rustls::RootCertStore, TlsError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let bad = |e: &dyn std::fmt::Display| TlsError::Certificate(e.to_string());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(ca.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    Ok(roots)
}

/// The KV transport's crypto: ring's suites, AES-128-GCM first (the bulk cipher of every KV
/// byte; as strong as needed for a session key, and faster than AES-256 here).
fn kv_provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::{self, cipher_suite};
    let mut p = ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != cipher_suite::TLS13_AES_128_GCM_SHA256.suite());
    Arc::new(p)
}

type ChainAndKey = (
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
);

/// This process's certificate chain and private key, from PEM.
fn chain_and_key(cert_pem: &str, key_pem: &str) -> Result<ChainAndKey, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |e: &dyn std::fmt::Display| TlsError::Certificate(e.to_string());
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(&e))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| bad(&e))?;
    Ok((chain, key))
}

/// The client side with rustls directly (the KV transport): TLS 1.3 only, the CA as the only
/// root, this process's certificate presented.
fn client_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
    alpn: &[u8],
) -> Result<rustls::ClientConfig, TlsError> {
    let bad = |e: &dyn std::fmt::Display| TlsError::Certificate(e.to_string());
    let (chain, key) = chain_and_key(cert_pem, key_pem)?;
    let mut cfg = rustls::ClientConfig::builder_with_provider(kv_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| bad(&e))?
        .with_root_certificates(roots(ca_pem)?)
        .with_client_auth_cert(chain, key)
        .map_err(|e| bad(&e))?;
    cfg.alpn_protocols = vec![alpn.to_vec()];
    Ok(cfg)
}

/// The server side: this certificate, client certificates required and verified against the
/// CA (webpki: chain, validity, client-auth usage), application protocol `alpn` only.
fn server_config(
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
    alpn: &[u8],
    provider: Arc<rustls::crypto::CryptoProvider>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<rustls::ServerConfig, TlsError> {
    let bad = |e: &dyn std::fmt::Display| TlsError::Certificate(e.to_string());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(ca_pem)?),
        provider.clone(),
    )
    .build()
    .map_err(|e| bad(&e))?;
    let (chain, key) = chain_and_key(cert_pem, key_pem)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| bad(&e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| bad(&e))?;
    cfg.alpn_protocols = vec![alpn.to_vec()];
    Ok(cfg)
}

/// How a process talks to the fleet.
#[derive(Clone, Debug)]
pub enum Security {
    /// Mutual TLS (the default: a node without `[tls]` material does not start).
    Tls(NodeTls),
    /// Plaintext, only on loopback (`[tls] insecure_loopback = true`; recorded at start).
    InsecureLoopback,
}

/// The authenticated caller of a request, put in its extensions by [`Security::interceptor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller(pub NodeIdentity);

impl Security {
    /// From `[tls]`: TLS material from files, or the explicit insecure mode.
    pub fn from_section(s: &TlsSection) -> Result<Self, TlsError> {
        if s.insecure_loopback {
            return Ok(Security::InsecureLoopback);
        }
        let read = |what: &str, p: &Option<std::path::PathBuf>| {
            let p = p.as_ref().ok_or_else(|| {
                TlsError::Config(format!(
                    "{what} is not set: give the CA, this node's certificate and key (`custody certs` makes them), or insecure_loopback = true for a loopback-only test"
                ))
            })?;
            std::fs::read_to_string(p).map_err(|source| TlsError::Read {
                path: p.display().to_string(),
                source,
            })
        };
        let accept = s
            .accept
            .iter()
            .map(|a| NodeIdentity::parse(a))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Security::Tls(NodeTls::from_pem(
            &read("ca", &s.ca)?,
            &read("cert", &s.cert)?,
            &read("key", &s.key)?,
            accept,
        )?))
    }

    /// The KV transport's encryption for a node of `role` (`Decode`: the target's side;
    /// `Prefill`: the initiator's, writing to the decode node this process deals with), when
    /// `on` (`[disagg] transport_encryption`). It needs the certificates: refused in the
    /// insecure mode.
    pub fn kv_encryption(&self, role: Role, on: bool) -> Result<KvEncryption, TlsError> {
        if !on {
            return Ok(KvEncryption::Off);
        }
        let Security::Tls(t) = self else {
            return Err(TlsError::Config(
                "transport_encryption needs the [tls] certificates (not insecure_loopback)".into(),
            ));
        };
        match role {
            Role::Decode => Ok(t.kv_server()),
            Role::Prefill => t.kv_client(t.peer(Role::Decode)?),
            Role::Front => Err(TlsError::Config("a front has no KV transport".into())),
        }
    }

    /// This process's identity (none in the insecure mode).
    pub fn own(&self) -> Option<NodeIdentity> {
        match self {
            Security::Tls(t) => Some(t.own()),
            Security::InsecureLoopback => None,
        }
    }

    /// The insecure mode binds and connects only on loopback.
    pub fn check_addr(&self, addr: SocketAddr) -> Result<(), TlsError> {
        match self {
            Security::InsecureLoopback if !addr.ip().is_loopback() => {
                Err(TlsError::NotLoopback(addr.to_string()))
            }
            _ => Ok(()),
        }
    }

    /// [`Self::check_addr`] for a `host:port` or `http://host:port` a client connects to.
    pub fn check_url(&self, url: &str) -> Result<(), TlsError> {
        if matches!(self, Security::Tls(_)) {
            return Ok(());
        }
        let host = url
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .rsplit_once(':')
            .map_or(url, |(h, _)| h)
            .trim_matches(['[', ']']);
        let loopback =
            host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        if loopback {
            Ok(())
        } else {
            Err(TlsError::NotLoopback(url.to_owned()))
        }
    }

    /// Admit `req`'s caller if its certificate names one of `roles` among the accepted
    /// identities; the insecure mode admits every (loopback) caller without an identity.
    pub fn admit<T>(
        &self,
        req: &Request<T>,
        roles: &[Role],
    ) -> Result<Option<NodeIdentity>, Status> {
        let Security::Tls(t) = self else {
            return Ok(None);
        };
        let certs = req
            .peer_certs()
            .ok_or_else(|| Status::unauthenticated("no client certificate"))?;
        let leaf = certs
            .first()
            .ok_or_else(|| Status::unauthenticated("no client certificate"))?;
        let id = NodeIdentity::of_certificate(leaf)
            .map_err(|e| Status::unauthenticated(e.to_string()))?;
        if !roles.contains(&id.role) || !t.accept.contains(&id) {
            tracing::warn!(caller = %id, "refused: not an identity this node accepts");
            return Err(Status::permission_denied(format!(
                "{id} is not accepted here (this node accepts {})",
                t.accept
                    .iter()
                    .filter(|a| roles.contains(&a.role))
                    .map(|a| a.uri())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(Some(id))
    }

    /// A tonic interceptor admitting callers of `roles` ([`Self::admit`]); the caller's identity
    /// goes into the request's extensions as [`Caller`].
    pub fn interceptor(
        &self,
        roles: &'static [Role],
    ) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone + Send + 'static {
        let sec = self.clone();
        move |mut req: Request<()>| {
            if let Some(id) = sec.admit(&req, roles)? {
                req.extensions_mut().insert(Caller(id));
            }
            Ok(req)
        }
    }

    /// A channel to `url` (`http://host:port`) of the peer of `role`: over mutual TLS verifying
    /// the peer's certificate, or plaintext on loopback.
    pub async fn channel(
        &self,
        url: &str,
        role: Role,
    ) -> Result<tonic::transport::Channel, ChannelError> {
        let peer = match self {
            Security::Tls(t) => Some(t.peer(role)?),
            Security::InsecureLoopback => None,
        };
        Ok(self.endpoint(url, peer)?.connect().await?)
    }

    /// A channel to `url` whose certificate must name exactly `peer` (one of many nodes of a
    /// role: a fleet), connecting on first use and reconnecting after a loss — a peer that is
    /// down now is not an error until a call is made.
    pub fn channel_lazy(
        &self,
        url: &str,
        peer: NodeIdentity,
    ) -> Result<tonic::transport::Channel, ChannelError> {
        let peer = matches!(self, Security::Tls(_)).then_some(peer);
        Ok(self
            .endpoint(url, peer)?
            .connect_timeout(std::time::Duration::from_secs(2))
            .connect_lazy())
    }

    fn endpoint(
        &self,
        url: &str,
        peer: Option<NodeIdentity>,
    ) -> Result<tonic::transport::Endpoint, ChannelError> {
        self.check_url(url)?;
        Ok(match (self, peer) {
            // tonic speaks TLS only to an `https` URI, whatever the channel's TLS config says.
            (Security::Tls(t), Some(peer)) => {
                let host = url
                    .trim_start_matches("http://")
                    .trim_start_matches("https://");
                tonic::transport::Endpoint::from_shared(format!("https://{host}"))?
                    .tls_config(t.client(peer))?
            }
            (Security::Tls(_), None) => {
                return Err(ChannelError::Tls(TlsError::Config(format!(
                    "no identity to verify {url} by"
                ))));
            }
            (Security::InsecureLoopback, _) => {
                tonic::transport::Endpoint::from_shared(url.to_owned())?
            }
        })
    }

    /// The KV transport's encryption for a prefill node writing to decode node `peer` (one of
    /// a fleet's), when `on`; refused in the insecure mode.
    pub fn kv_encryption_to(&self, peer: NodeIdentity, on: bool) -> Result<KvEncryption, TlsError> {
        if !on {
            return Ok(KvEncryption::Off);
        }
        match self {
            Security::Tls(t) => t.kv_client(peer),
            Security::InsecureLoopback => Err(TlsError::Config(
                "transport_encryption needs the [tls] certificates (not insecure_loopback)".into(),
            )),
        }
    }
}

/// Why a channel to a peer could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("{0}")]
    Transport(#[from] tonic::transport::Error),
}

/// How long a node certificate is valid.
#[derive(Clone, Copy, Debug)]
pub enum Validity {
    /// From yesterday for this many days.
    Days(u32),
    /// Expired: valid only in 2020 (for tests of the refusal).
    Expired,
}

/// A node certificate and its key (PEM).
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A fleet's certificate authority: makes the CA and node certificates (`custody certs`, and
/// the tests' fleets — real certificates, the same code path as a deployment's).
pub struct Fleet {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_pem: String,
    ca_key_pem: String,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Fleet {
    /// A new CA named `name`, valid from yesterday for `days`.
    pub fn new(name: &str, days: u32) -> Result<Self, TlsError> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut params, Validity::Days(days));
        let ca = params.self_signed(&key)?;
        let ca_key_pem = key.serialize_pem();
        Ok(Self {
            issuer: rcgen::Issuer::new(params, key),
            ca_pem: ca.pem(),
            ca_key_pem,
        })
    }

    /// An existing CA, from its certificate and key (PEM).
    pub fn load(ca_pem: &str, ca_key_pem: &str) -> Result<Self, TlsError> {
        let key = rcgen::KeyPair::from_pem(ca_key_pem)?;
        Ok(Self {
            issuer: rcgen::Issuer::from_ca_cert_pem(ca_pem, key)?,
            ca_pem: ca_pem.to_owned(),
            ca_key_pem: ca_key_pem.to_owned(),
        })
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    pub fn ca_key_pem(&self) -> &str {
        &self.ca_key_pem
    }

    /// A certificate for `id`: its URI SAN, DNS SANs `id.dns_name()`, `localhost` and `hosts`,
    /// IP SAN 127.0.0.1 (and any IP in `hosts`); server and client use.
    pub fn issue(
        &self,
        id: NodeIdentity,
        hosts: &[String],
        validity: Validity,
    ) -> Result<Issued, TlsError> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, SanType};
        let key = KeyPair::generate()?;
        let mut names = vec![id.dns_name(), "localhost".to_owned()];
        names.extend(
            hosts
                .iter()
                .filter(|h| h.parse::<IpAddr>().is_err())
                .cloned(),
        );
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, id.uri());
        params
            .subject_alt_names
            .push(SanType::URI(id.uri().try_into()?));
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::from([127, 0, 0, 1])));
        for ip in hosts.iter().filter_map(|h| h.parse::<IpAddr>().ok()) {
            params.subject_alt_names.push(SanType::IpAddress(ip));
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        set_validity(&mut params, validity);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// [`NodeTls`] for `id` dealing with `accept`, from a fresh certificate (tests, the demo).
    pub fn node_tls(
        &self,
        id: NodeIdentity,
        accept: Vec<NodeIdentity>,
    ) -> Result<NodeTls, TlsError> {
        let issued = self.issue(id, &[], Validity::Days(2))?;
        NodeTls::from_pem(&self.ca_pem, &issued.cert_pem, &issued.key_pem, accept)
    }
}

fn set_validity(params: &mut rcgen::CertificateParams, validity: Validity) {
    match validity {
        Validity::Days(days) => {
            let now = time::OffsetDateTime::now_utc();
            params.not_before = now - time::Duration::days(1);
            params.not_after = now + time::Duration::days(i64::from(days));
        }
        Validity::Expired => {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 12, 31);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_and_bad_ones_are_refused() {
        let id = NodeIdentity::new(Role::Decode, 2);
        assert_eq!(id.uri(), "custody-node:decode:2");
        assert_eq!(id.dns_name(), "decode-2.custody");
        assert_eq!(NodeIdentity::parse(&id.uri()).expect("parse"), id);
        for bad in [
            "custody-node:cook:1",
            "custody-node:decode",
            "node:decode:2",
            "custody-node:front:x",
        ] {
            assert!(NodeIdentity::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_issued_certificate_names_its_identity() {
        let fleet = Fleet::new("test fleet", 2).expect("ca");
        let id = NodeIdentity::new(Role::Front, 0);
        let tls = fleet
            .node_tls(id, vec![NodeIdentity::new(Role::Prefill, 1)])
            .expect("tls");
        assert_eq!(tls.own(), id);
        assert_eq!(tls.peer(Role::Prefill).expect("peer").node, 1);
        assert!(tls.peer(Role::Decode).is_err());
        let again = Fleet::load(fleet.ca_pem(), fleet.ca_key_pem()).expect("load");
        assert!(
            again
                .issue(id, &["10.0.0.2".into()], Validity::Days(1))
                .is_ok()
        );
    }

    #[test]
    fn the_insecure_mode_is_loopback_only() {
        let s = Security::InsecureLoopback;
        assert!(s.check_addr("127.0.0.1:1".parse().expect("addr")).is_ok());
        assert!(s.check_addr("10.0.0.1:1".parse().expect("addr")).is_err());
        assert!(s.check_url("http://127.0.0.1:50051").is_ok());
        assert!(s.check_url("http://localhost:50051").is_ok());
        assert!(s.check_url("http://10.1.2.3:50051").is_err());
    }
}
