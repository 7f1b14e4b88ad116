//! `tcp`: the one-sided-write transport in software over TCP, for machines without RDMA.
//!
//! Wire format (little-endian). Initiator → target, one frame per work request:
//! `magic u32 | opcode u32 | wr_id u64 | remote_addr u64 | rkey u32 | imm (host order) u32 |
//! flags u32 | len u32 | payload[len]` (40-byte header). Target → initiator, one acknowledgement
//! per *signaled* work request: `magic u32 | status u32 | wr_id u64 | byte_len u32 | pad u32`.
//!
//! Threads: the target has only an acceptor; its connections are non-blocking sockets read by
//! [`KvTransport::poll_recv`] on the caller's thread (the thread that owns the memory). A frame's
//! header is checked (key valid, range within the region) before any of its payload is read,
//! and the payload is read from the socket **straight into the destination**
//! ([`TargetMemory::dest`]: no staging copy; memory without direct landing gets a staged
//! [`TargetMemory::write`]). The key is checked again before every piece, so once `invalidate`
//! returns not one more byte of that key lands — the rest of a frame in progress is read and
//! discarded, and the write fails with `REM_ACCESS_ERR`. A target that stops polling stops
//! reading: the sender blocks on TCP flow control (backpressure, bounded by the socket buffers).
//! The initiator has one reader for acknowledgements; when the connection drops, every
//! outstanding signaled work request completes with `WR_FLUSH_ERR` (as a verbs QP in error).
//!
//! Authentication: the target's acceptor hands a connection to `poll_recv` only after it proved
//! the secret of a live [`Pairing`] ([`auth`]: challenge–response both ways, on its own thread,
//! bounded in number and time); until then not one byte of it is read as a frame. A refused
//! connection is closed, logged and counted ([`TargetStats::refused_connections`]). Each key is
//! registered for one pairing and lands only writes from connections of that pairing; keys
//! (`rkey` and the region's `base`: 64 random bits) are never reused. With encryption on
//! ([`KvEncryption`]), every connection is TLS (rustls; client certificates required) and the
//! pairing proof runs inside it.
//!
//! Fault injection (tests only, named as such): corrupting a payload in flight, holding a key's
//! writes back to deliver them late, cutting the connection.

mod auth;
mod keys;
mod wire;

use crate::Discard;
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{IoSlice, IoSliceMut, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use wire::KvEncryption;
use wire::{AckReader, Io, SendWire, Wire};

pub use super::TargetStats;

#[cfg(feature = "fault-injection")]
use super::FaultInjection;
use super::abi::{self, SEND_SIGNALED, SendWr, WR_RDMA_WRITE_WITH_IMM, Wc, wc_opcode, wc_status};
use super::pairing::random_u32;
use super::{KeyInvalidated, KvTransport, Pairing, Region, TargetMemory, TransportError};

const MAGIC_WR: u32 = 0x4b56_5752; // "KVWR"
const MAGIC_ACK: u32 = 0x4b56_4143; // "KVAC"
const WR_HDR: usize = 40;
const ACK_LEN: usize = 24;
/// Largest single write accepted (bounds a reader's allocation).
pub const MAX_WRITE_BYTES: u32 = 64 << 20;
/// Longest work-request chain accepted in one post (bounds the walk).
pub const MAX_CHAIN: usize = 4096;
/// Completions queued for the initiator (acknowledgements not yet polled).
const ACK_QUEUE: usize = 8192;
/// Connections waiting to be picked up by `poll_recv`.
const NEW_CONN_QUEUE: usize = 64;
/// Bytes one `poll_recv` reads at most, so that a large transfer cannot starve the caller's other
/// work (the decode node steps its batch between polls).
const POLL_BYTES_MAX: usize = 32 << 20;
/// Size of the buffer a refused write's payload is drained through.
const SINK_BYTES: usize = 64 << 10;
/// How long a new connection may take, in all, to prove its pairing (and, encrypted, its TLS
/// handshake): one deadline for the whole exchange, not per read, so a peer trickling bytes
/// holds its slot no longer than this.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections authenticating at once at most (each on its own short-lived thread); more are
/// refused at accept, so a flood of silent connections cannot exhaust threads.
pub const MAX_AUTHENTICATING: usize = 16;
/// Connections authenticating at once from one peer address: one host cannot fill the gate
/// and lock the paired node out.
pub const MAX_AUTHENTICATING_PER_PEER: usize = 4;
/// Live connections per pairing (a reconnect opens a new one; more are refused when accepted).
pub const MAX_CONNS_PER_PAIRING: usize = 4;
/// Acknowledgement bytes a connection may have waiting to be written: past it, its frames are
/// not read until the peer reads its acknowledgements (a peer that never reads cannot grow it).
const ACKS_PENDING_MAX: usize = 1 << 20;
/// Live pairings a target holds at most (one per paired initiator; a re-pairing replaces).
pub const MAX_PAIRINGS: usize = 256;
/// Region keys live at once on a target at most (each is a reservation of a decode node, whose
/// own bound is far lower): the live-key map never grows past it.
pub const MAX_LIVE_KEYS: usize = 1 << 16;
/// How long the acceptor pauses after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// A whole write held back or replayed by fault injection (staged in memory).
#[derive(Debug)]
struct Frame {
    conn: u64,
    pairing: u64,
    opcode: u32,
    wr_id: u64,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
    flags: u32,
    payload: Vec<u8>,
}

/// A live (registered, not invalidated) region key: writes with it land if in range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyEntry {
    len: u64,
    base: u64,
    pairing: u64,
}

#[derive(Debug, Default)]
struct Initiator {
    stream: Option<SendWire>,
    completions: Option<Receiver<Wc>>,
    /// Completion queues of earlier (lost) connections, drained until their readers finish:
    /// their flush errors must reach the caller after a reconnect.
    retired: Vec<Receiver<Wc>>,
    outstanding: Arc<Mutex<HashSet<u64>>>,
    alive: Arc<AtomicBool>,
}

/// How the payload of the frame being read lands.
#[derive(Debug)]
enum Mode {
    /// Read from the socket straight into the target memory at region offset `offset`.
    Direct { offset: u64 },
    /// Read into a buffer, landed (or held) when complete.
    Staged { buf: Vec<u8>, hold: bool },
    /// Refused (bad key, out of range, invalidated meanwhile, memory refused): drained.
    Refused,
}

/// A frame whose header was read and whose payload is being read.
#[derive(Debug)]
struct InFrame {
    opcode: u32,
    wr_id: u64,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
    flags: u32,
    len: u32,
    got: u32,
    mode: Mode,
}

/// One accepted connection (non-blocking), read by `poll_recv`.
#[derive(Debug)]
struct Conn {
    id: u64,
    /// The pairing this connection proved: only keys registered for it land.
    pairing: u64,
    stream: Wire,
    hdr: [u8; WR_HDR],
    hdr_got: usize,
    cur: Option<InFrame>,
    /// Acknowledgement bytes not yet written (the socket is non-blocking).
    acks: Vec<u8>,
    closed: bool,
}

/// Everything of the target but its connections (so both can be borrowed at once).
#[derive(Debug)]
struct TargetState {
    new_conns: Receiver<Accepted>,
    /// The live keys only (at most [`MAX_LIVE_KEYS`]): an invalidated key leaves the map, and
    /// `key_seq` guarantees it is never issued again.
    keys: HashMap<u32, KeyEntry>,
    key_seq: keys::KeySequence,
    pairings: Arc<Mutex<HashMap<u64, Pairing>>>,
    refused: Arc<AtomicU64>,
    /// Set when the transport is dropped: the acceptor stops.
    gone: Arc<AtomicBool>,
    stats: TargetStats,
    local_addr: SocketAddr,
    /// Frames held back by fault injection, delivered by `ReleaseHeld`.
    held: VecDeque<Frame>,
    hold_keys: HashSet<u32>,
    replay: VecDeque<Frame>,
    corrupt_next: bool,
    sink: Vec<u8>,
    poll_bytes_max: usize,
}

#[derive(Debug)]
struct Target {
    conns: Vec<Conn>,
    st: TargetState,
}

/// The TCP transport. A node calls [`TcpTransport::listen`] (target) or
/// [`TcpTransport::connect`] (initiator), or both.
#[derive(Debug)]
pub struct TcpTransport {
    ctx: u64,
    init: Initiator,
    target: Option<Target>,
    encryption: KvEncryption,
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if let Some(t) = &self.target {
            t.st.gone.store(true, Ordering::Release);
        }
    }
}

/// A connection that proved its pairing, for `poll_recv`.
#[derive(Debug)]
struct Accepted {
    id: u64,
    pairing: u64,
    wire: Wire,
}

/// What the acceptor's authenticating threads share with the transport.
#[derive(Clone)]
struct Gate {
    pairings: Arc<Mutex<HashMap<u64, Pairing>>>,
    refused: Arc<AtomicU64>,
    authenticating: Arc<AtomicUsize>,
    /// Connections authenticating now, by peer address.
    per_peer: Arc<Mutex<HashMap<std::net::IpAddr, usize>>>,
    gone: Arc<AtomicBool>,
    tls: Option<Arc<rustls::ServerConfig>>,
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

impl TcpTransport {
    pub fn new(node: u32) -> Self {
        Self {
            ctx: abi::new_ctx(node),
            init: Initiator::default(),
            target: None,
            encryption: KvEncryption::Off,
        }
    }

    /// TLS on this transport's connections: [`KvEncryption::Server`] for a target (before
    /// [`TcpTransport::listen`]), [`KvEncryption::Client`] for an initiator.
    pub fn set_encryption(&mut self, e: KvEncryption) -> Result<(), TransportError> {
        if self.target.is_some() {
            return Err(TransportError::Tls(
                "encryption must be set before the target listens".into(),
            ));
        }
        self.encryption = e;
        Ok(())
    }

    /// The probe context of this instance.
    pub fn ctx(&self) -> u64 {
        self.ctx
    }

    /// Become a target listening on `addr` (port 0 = any). Returns the bound address.
    pub fn listen(&mut self, addr: SocketAddr) -> Result<SocketAddr, TransportError> {
        let listener = TcpListener::bind(addr)?;
        let local_addr = listener.local_addr()?;
        let (tx, rx) = sync_channel::<Accepted>(NEW_CONN_QUEUE);
        let gate = Gate {
            pairings: Arc::default(),
            refused: Arc::default(),
            authenticating: Arc::default(),
            per_peer: Arc::default(),
            gone: Arc::default(),
            tls: match &self.encryption {
                KvEncryption::Off => None,
                KvEncryption::Server(cfg) => Some(cfg.clone()),
                KvEncryption::Client { .. } => {
                    return Err(TransportError::Tls(
                        "a target needs the server side of KV encryption".into(),
                    ));
                }
            },
        };
        let g = gate.clone();
        std::thread::Builder::new()
            .name("kv-tcp-accept".into())
            .spawn(move || accept_loop(listener, tx, g))?;
        self.target = Some(Target {
            conns: Vec::new(),
            st: TargetState {
                new_conns: rx,
                keys: HashMap::new(),
                key_seq: keys::KeySequence::new(),
                pairings: gate.pairings,
                refused: gate.refused,
                gone: gate.gone,
                stats: TargetStats::default(),
                local_addr,
                held: VecDeque::new(),
                hold_keys: HashSet::new(),
                replay: VecDeque::new(),
                corrupt_next: false,
                sink: vec![0; SINK_BYTES],
                poll_bytes_max: POLL_BYTES_MAX,
            },
        });
        Ok(local_addr)
    }

    /// The target's listening address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.target.as_ref().map(|t| t.st.local_addr)
    }

    /// Become an initiator connected to the target at `addr`, proving `pairing` (inside TLS
    /// when encryption is on). Nothing is sent as a frame before both sides proved the secret.
    pub fn connect(&mut self, addr: SocketAddr, pairing: &Pairing) -> Result<(), TransportError> {
        let mut stream = TcpStream::connect_timeout(&addr, AUTH_TIMEOUT)?;
        stream.set_nodelay(true)?;
        set_socket_buffers(&stream);
        stream.set_read_timeout(Some(AUTH_TIMEOUT))?;
        stream.set_write_timeout(Some(AUTH_TIMEOUT))?;
        let (send, reader) = match &self.encryption {
            KvEncryption::Off => {
                auth::initiator(&mut stream, pairing)?;
                let reader = AckReader::Plain(stream.try_clone()?);
                (SendWire::Plain(stream), reader)
            }
            KvEncryption::Client {
                config,
                server_name,
            } => {
                let conn = wire::client_session(config, server_name, &mut stream, pairing)?;
                let conn = Arc::new(Mutex::new(conn));
                let reader = AckReader::tls(Arc::clone(&conn), stream.try_clone()?);
                (SendWire::Tls { conn, sock: stream }, reader)
            }
            KvEncryption::Server(_) => {
                return Err(TransportError::Tls(
                    "an initiator needs the client side of KV encryption".into(),
                ));
            }
        };
        let sock = match &send {
            SendWire::Plain(s) | SendWire::Tls { sock: s, .. } => s,
        };
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(None)?;
        let (tx, rx) = sync_channel::<Wc>(ACK_QUEUE);
        let outstanding: Arc<Mutex<HashSet<u64>>> = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let (out2, alive2, ctx) = (Arc::clone(&outstanding), Arc::clone(&alive), self.ctx);
        std::thread::Builder::new()
            .name("kv-tcp-acks".into())
            .spawn(move || ack_loop(reader, tx, out2, alive2, ctx))?;
        let mut retired = std::mem::take(&mut self.init.retired);
        retired.extend(self.init.completions.take());
        if let Some(old) = self.init.stream.take() {
            old.shutdown();
        }
        self.init = Initiator {
            stream: Some(send),
            completions: Some(rx),
            retired,
            outstanding,
            alive,
        };
        Ok(())
    }

    pub fn target_stats(&self) -> TargetStats {
        self.target
            .as_ref()
            .map(|t| TargetStats {
                refused_connections: t.st.refused.load(Ordering::Relaxed),
                ..t.st.stats
            })
            .unwrap_or_default()
    }

    /// Bound the bytes one `poll_recv` reads (default 32 MiB): smaller keeps the caller's other
    /// work responsive during large transfers. Tests use tiny values to stop mid-write.
    #[cfg(test)]
    fn set_poll_bytes_max(&mut self, bytes: usize) {
        assert!(bytes > 0);
        if let Some(t) = &mut self.target {
            t.st.poll_bytes_max = bytes;
        }
    }

    #[cfg(any(test, feature = "fault-injection"))]
    /// Fault injection: flip one byte of the next payload that lands (corruption in flight that
    /// TCP's own checksum would not catch, e.g. a buggy NIC or memory error).
    pub fn fault_inject_corrupt_next_payload(&mut self) {
        if let Some(t) = &mut self.target {
            t.st.corrupt_next = true;
        }
    }

    #[cfg(any(test, feature = "fault-injection"))]
    /// Fault injection: hold back every arriving write of `rkey` (a delayed packet).
    pub fn fault_inject_hold_key(&mut self, rkey: u32) {
        if let Some(t) = &mut self.target {
            t.st.hold_keys.insert(rkey);
        }
    }

    #[cfg(any(test, feature = "fault-injection"))]
    /// Fault injection: deliver every held write at the next `poll_recv` (late, possibly after
    /// the key was invalidated and the pages reallocated). Returns how many.
    pub fn fault_inject_release_held(&mut self) -> usize {
        let Some(t) = &mut self.target else { return 0 };
        let st = &mut t.st;
        st.hold_keys.clear();
        let n = st.held.len();
        st.replay.extend(st.held.drain(..));
        n
    }

    #[cfg(any(test, feature = "fault-injection"))]
    /// Fault injection: cut the initiator's connection abruptly.
    pub fn fault_inject_disconnect(&mut self) {
        if let Some(s) = &self.init.stream {
            s.shutdown();
        }
    }

    fn send_chain(&mut self, first: &SendWr) -> Result<(), TransportError> {
        let Some(stream) = self.init.stream.as_mut() else {
            return Err(TransportError::NotConnected);
        };
        if !self.init.alive.load(Ordering::Acquire) {
            return Err(TransportError::Disconnected);
        }
        // SAFETY: the caller of `post_write` guarantees the chain's pointers are valid.
        let chain = unsafe { crate::validated_chain(first, MAX_CHAIN, usize::MAX) }?;
        // The whole chain goes out in one vectored write (few syscalls per page): first every
        // frame header, then the gather list interleaving headers and payloads.
        let mut hdrs: Vec<[u8; WR_HDR]> = Vec::with_capacity(chain.len());
        let mut lists: Vec<&[abi::Sge]> = Vec::with_capacity(chain.len());
        for &w in &chain {
            // SAFETY: `w` is of the validated chain.
            let sges = unsafe { crate::sges_of(w) };
            let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
            if total > u64::from(MAX_WRITE_BYTES) {
                return Err(TransportError::InvalidWr(format!(
                    "write of {total} B exceeds {MAX_WRITE_BYTES}"
                )));
            }
            let mut hdr = [0u8; WR_HDR];
            hdr[0..4].copy_from_slice(&MAGIC_WR.to_le_bytes());
            hdr[4..8].copy_from_slice(&w.opcode.to_le_bytes());
            hdr[8..16].copy_from_slice(&w.wr_id.to_le_bytes());
            hdr[16..24].copy_from_slice(&w.remote_addr.to_le_bytes());
            hdr[24..28].copy_from_slice(&w.rkey.to_le_bytes());
            hdr[28..32].copy_from_slice(&u32::from_be(w.imm_data).to_le_bytes());
            hdr[32..36].copy_from_slice(&w.send_flags.to_le_bytes());
            hdr[36..40].copy_from_slice(&(total as u32).to_le_bytes());
            hdrs.push(hdr);
            lists.push(sges);
        }
        // Outstanding before the bytes go: an acknowledgement can arrive before this returns.
        for w in &chain {
            if w.send_flags & SEND_SIGNALED != 0
                && let Ok(mut o) = self.init.outstanding.lock()
            {
                o.insert(w.wr_id);
            }
        }
        // The frames go out in vectored writes of about WRITE_BYTES_GROUP each (whole frames):
        // a long chain (several pages) streams as the receiver drains it, page by page, instead
        // of as one write the size of the transfer.
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(IOV_GROUP_MAX + 64);
        let mut group_bytes = 0usize;
        for (i, (hdr, sges)) in hdrs.iter().zip(&lists).enumerate() {
            iov.push(IoSlice::new(hdr));
            group_bytes += hdr.len();
            for s in *sges {
                // SAFETY: the caller guarantees each SGE names `length` readable bytes.
                let bytes =
                    unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                iov.push(IoSlice::new(bytes));
                group_bytes += bytes.len();
            }
            let last = i + 1 == hdrs.len();
            if last || group_bytes >= WRITE_BYTES_GROUP || iov.len() >= IOV_GROUP_MAX {
                if let Err(e) = stream.write_all_vectored(&mut iov) {
                    self.init.alive.store(false, Ordering::Release);
                    stream.shutdown();
                    return Err(e.into());
                }
                iov.clear();
                group_bytes = 0;
            }
        }
        Ok(())
    }
}

/// A chain's frames are written once at least this many bytes are gathered (whole frames: a
/// full page of the embedded model is ~360 KiB in 3 frames, so about one write per page, as when
/// pages were posted one by one).
const WRITE_BYTES_GROUP: usize = 256 << 10;
/// I/O vectors per write at most (Linux's IOV_MAX is 1,024; std splits above it anyway).
const IOV_GROUP_MAX: usize = 512;

/// Socket buffer size asked for on both ends: large enough for several pages in flight, so the
/// sender and the reader run without a context switch per frame.
const SOCKET_BUF_BYTES: libc::c_int = 4 << 20;

fn set_socket_buffers(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        let v = SOCKET_BUF_BYTES;
        // SAFETY: a valid socket fd, a pointer to a live c_int and its size, as setsockopt wants.
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&raw const v).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(
                "setsockopt buffer size failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn accept_loop(listener: TcpListener, tx: SyncSender<Accepted>, gate: Gate) {
    for stream in listener.incoming() {
        if gate.gone.load(Ordering::Acquire) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "KV transport: accepting a connection failed");
                std::thread::sleep(ACCEPT_RETRY_PAUSE);
                continue;
            }
        };
        let peer = stream.peer_addr().ok();
        let Some(slot) = AuthSlot::take(&gate, peer) else {
            gate.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                ?peer,
                "KV transport: refused, too many connections authenticating"
            );
            stream
                .shutdown(Shutdown::Both)
                .discard("shutting down a refused connection that may already be gone");
            continue;
        };
        let (tx, g) = (tx.clone(), gate.clone());
        let spawned = std::thread::Builder::new()
            .name("kv-tcp-auth".into())
            .spawn(move || {
                // The slot is held until the connection is handed over (or refused).
                let _slot = slot;
                let r = authenticate(stream, &g);
                match r {
                    Ok(a) => {
                        tracing::debug!(
                            ?peer,
                            pairing = a.pairing,
                            "KV transport connection accepted"
                        );
                        if tx.send(a).is_err() {
                            g.gone.store(true, Ordering::Release);
                        }
                    }
                    Err(auth::Refusal::Silent) => {
                        tracing::debug!(?peer, "KV transport: closed before authenticating");
                    }
                    Err(e) => {
                        g.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(?peer, reason = %e, "KV transport connection refused");
                    }
                }
            });
        if let Err(e) = spawned {
            // The closure (and its slot) was dropped with the failed spawn.
            gate.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(?peer, error = %e, "KV transport: refused, no thread to authenticate");
        }
    }
}

/// One authenticating connection's place in the gate (overall and per peer address), given
/// back when dropped.
struct AuthSlot {
    gate: Gate,
    peer: Option<std::net::IpAddr>,
}

impl AuthSlot {
    fn take(gate: &Gate, peer: Option<SocketAddr>) -> Option<Self> {
        let ip = peer.map(|p| p.ip());
        let mut per = gate.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        let mine = ip.map_or(0, |ip| per.get(&ip).copied().unwrap_or(0));
        if mine >= MAX_AUTHENTICATING_PER_PEER
            || gate.authenticating.load(Ordering::Acquire) >= MAX_AUTHENTICATING
        {
            return None;
        }
        gate.authenticating.fetch_add(1, Ordering::AcqRel);
        if let Some(ip) = ip {
            *per.entry(ip).or_insert(0) += 1;
        }
        Some(Self {
            gate: gate.clone(),
            peer: ip,
        })
    }
}

impl Drop for AuthSlot {
    fn drop(&mut self) {
        self.gate.authenticating.fetch_sub(1, Ordering::AcqRel);
        if let Some(ip) = self.peer {
            let mut per = self.gate.per_peer.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = per.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    per.remove(&ip);
                }
            }
        }
    }
}

/// A socket whose reads and writes all share one deadline (the whole exchange's).
struct Deadline<'a> {
    s: &'a TcpStream,
    until: std::time::Instant,
}

impl Deadline<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        self.until
            .checked_duration_since(std::time::Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| std::io::ErrorKind::TimedOut.into())
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&*self.s).read(buf)
    }
}

impl std::io::Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&*self.s).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Authenticate a new connection (blocking, at most [`AUTH_TIMEOUT`] in all): TLS first when
/// encryption is on, then the pairing proof. Nothing it sends is read as a frame before that.
fn authenticate(stream: TcpStream, gate: &Gate) -> Result<Accepted, auth::Refusal> {
    stream.set_nodelay(true)?;
    set_socket_buffers(&stream);
    let mut io = Deadline {
        s: &stream,
        until: std::time::Instant::now() + AUTH_TIMEOUT,
    };
    let (pairing, tls) = match &gate.tls {
        None => (auth::target(&mut io, &gate.pairings)?, None),
        Some(cfg) => {
            let mut conn = rustls::ServerConnection::new(cfg.clone())
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            let mut said_anything = false;
            while conn.is_handshaking() {
                match conn.complete_io(&mut io) {
                    Ok((rd, _)) => said_anything |= rd > 0,
                    Err(e) if !said_anything && e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Err(auth::Refusal::Silent);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            let p = auth::target(&mut rustls::Stream::new(&mut conn, &mut io), &gate.pairings)?;
            (p, Some(conn))
        }
    };
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    stream.set_nonblocking(true)?;
    let wire = match tls {
        None => Wire::Plain(stream),
        Some(conn) => Wire::tls(conn, stream),
    };
    Ok(Accepted {
        id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        pairing,
        wire,
    })
}

/// A write whose bytes all arrived: its outcome, to acknowledge and complete.
struct Finished {
    opcode: u32,
    wr_id: u64,
    imm: u32,
    flags: u32,
    len: u32,
    status: u32,
}

enum Step {
    /// Bytes were read; the frame is not complete yet.
    Progress(usize),
    /// A frame completed (or was held back: `None`).
    Done(usize, Option<Finished>),
    Blocked,
    Closed,
}

/// Key, pairing and range check of a write of `len` bytes at `remote_addr` from a connection of
/// pairing `pairing`: its region offset.
fn check_range(
    st: &TargetState,
    rkey: u32,
    remote_addr: u64,
    len: u64,
    pairing: u64,
) -> Option<u64> {
    let &KeyEntry {
        len: region_len,
        base,
        pairing: owner,
    } = st.keys.get(&rkey)?;
    if owner != pairing {
        tracing::warn!(rkey, "KV write refused: the key belongs to another pairing");
        return None;
    }
    let offset = remote_addr.checked_sub(base)?;
    let end = offset.checked_add(len)?;
    (end <= region_len).then_some(offset)
}

/// Advance connection `c` by one read of at most `max_read` (> 0) bytes: a header, or a piece
/// of the current frame's payload.
fn read_step(
    c: &mut Conn,
    st: &mut TargetState,
    mem: &mut dyn TargetMemory,
    max_read: usize,
) -> Step {
    debug_assert!(max_read > 0);
    if c.cur.is_none() {
        let n = match c.stream.read(&mut c.hdr[c.hdr_got..]) {
            Io::Read(n) => n,
            Io::Blocked => return Step::Blocked,
            Io::Closed => return Step::Closed,
        };
        c.hdr_got += n;
        if c.hdr_got < WR_HDR {
            return Step::Progress(n);
        }
        c.hdr_got = 0;
        let h = &c.hdr;
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        if u32_at(0) != MAGIC_WR {
            tracing::warn!(
                conn = c.id,
                "KV transport: bad frame magic, closing the connection"
            );
            return Step::Closed;
        }
        let len = u32_at(36);
        if len > MAX_WRITE_BYTES {
            tracing::warn!(
                conn = c.id,
                len,
                "KV transport: oversized frame, closing the connection"
            );
            return Step::Closed;
        }
        let (rkey, remote_addr) = (u32_at(24), u64_at(16));
        // Held writes are judged when they are finally delivered (that is the point: a late
        // write after invalidation); everything else is judged now, before a byte lands.
        let mode = if st.hold_keys.contains(&rkey) {
            Mode::Staged {
                buf: vec![0; len as usize],
                hold: true,
            }
        } else {
            match check_range(st, rkey, remote_addr, u64::from(len), c.pairing) {
                None => Mode::Refused,
                Some(_) if st.corrupt_next || !mem.direct() => Mode::Staged {
                    buf: vec![0; len as usize],
                    hold: false,
                },
                Some(offset) => Mode::Direct { offset },
            }
        };
        c.cur = Some(InFrame {
            opcode: u32_at(4),
            wr_id: u64_at(8),
            remote_addr,
            rkey,
            imm: u32_at(28),
            flags: u32_at(32),
            len,
            got: 0,
            mode,
        });
        if len > 0 {
            return Step::Progress(n);
        }
        return Step::Done(n, finish(c, st, mem));
    }
    let Some(f) = c.cur.as_mut() else {
        return Step::Blocked;
    };
    debug_assert!(f.got < f.len);
    let rem = ((f.len - f.got) as usize).min(max_read);
    // Invalidation takes effect between any two pieces: not one more byte of the key lands.
    if matches!(f.mode, Mode::Direct { .. }) && !st.keys.contains_key(&f.rkey) {
        f.mode = Mode::Refused;
    }
    let io = match &mut f.mode {
        Mode::Direct { offset } => {
            let mut dests: Vec<&mut [u8]> = Vec::with_capacity(crate::MAX_LAND_DESTS);
            match mem.dests(f.rkey, *offset + u64::from(f.got), rem, &mut dests) {
                Ok(()) => {
                    debug_assert!(
                        !dests.is_empty() && dests.iter().map(|d| d.len()).sum::<usize>() <= rem
                    );
                    let mut iov: Vec<IoSliceMut<'_>> =
                        dests.into_iter().map(IoSliceMut::new).collect();
                    c.stream.read_vectored(&mut iov)
                }
                Err(e) => {
                    tracing::warn!(rkey = f.rkey, error = %e, "KV write refused by target memory");
                    f.mode = Mode::Refused;
                    return Step::Progress(0);
                }
            }
        }
        Mode::Staged { buf, .. } => {
            let start = f.got as usize;
            c.stream.read(&mut buf[start..start + rem])
        }
        Mode::Refused => {
            let k = rem.min(st.sink.len());
            c.stream.read(&mut st.sink[..k])
        }
    };
    let n = match io {
        Io::Read(n) => n,
        Io::Blocked => return Step::Blocked,
        Io::Closed => return Step::Closed,
    };
    f.got += n as u32;
    if f.got < f.len {
        return Step::Progress(n);
    }
    Step::Done(n, finish(c, st, mem))
}

/// The current frame of `c` is complete: decide its status (or hold it back).
fn finish(c: &mut Conn, st: &mut TargetState, mem: &mut dyn TargetMemory) -> Option<Finished> {
    let f = c.cur.take()?;
    let status = match f.mode {
        Mode::Direct { offset } => {
            if !st.keys.contains_key(&f.rkey) {
                st.stats.rejected_writes += 1;
                wc_status::REM_ACCESS_ERR
            } else {
                match mem.dest_done(f.rkey, offset, u64::from(f.len)) {
                    Ok(()) => {
                        st.stats.landed_writes += 1;
                        st.stats.landed_bytes += u64::from(f.len);
                        wc_status::SUCCESS
                    }
                    Err(e) => {
                        tracing::warn!(rkey = f.rkey, offset, error = %e, "KV write refused by target memory");
                        st.stats.rejected_writes += 1;
                        wc_status::REM_ACCESS_ERR
                    }
                }
            }
        }
        Mode::Refused => {
            st.stats.rejected_writes += 1;
            wc_status::REM_ACCESS_ERR
        }
        Mode::Staged { mut buf, hold } => {
            let frame_of = |payload| Frame {
                conn: c.id,
                pairing: c.pairing,
                opcode: f.opcode,
                wr_id: f.wr_id,
                remote_addr: f.remote_addr,
                rkey: f.rkey,
                imm: f.imm,
                flags: f.flags,
                payload,
            };
            if hold {
                st.held.push_back(frame_of(buf));
                return None;
            }
            if st.corrupt_next && !buf.is_empty() {
                st.corrupt_next = false;
                let i = buf.len() / 2;
                buf[i] ^= 0x40;
            }
            land(st, mem, &frame_of(buf))
        }
    };
    Some(Finished {
        opcode: f.opcode,
        wr_id: f.wr_id,
        imm: f.imm,
        flags: f.flags,
        len: f.len,
        status,
    })
}

/// Acknowledge (if signaled) and complete (if with immediate data and successful) a write.
/// (The receive completions are announced to the probe point by `poll_recv`, one batch per call.)
fn complete(acks: &mut Vec<u8>, fin: &Finished, out: &mut Vec<Wc>) {
    if fin.flags & SEND_SIGNALED != 0 {
        acks.extend_from_slice(&MAGIC_ACK.to_le_bytes());
        acks.extend_from_slice(&fin.status.to_le_bytes());
        acks.extend_from_slice(&fin.wr_id.to_le_bytes());
        acks.extend_from_slice(&fin.len.to_le_bytes());
        acks.extend_from_slice(&[0u8; 4]);
    }
    if fin.status == wc_status::SUCCESS && fin.opcode == WR_RDMA_WRITE_WITH_IMM {
        let wc = Wc::new(
            fin.wr_id,
            fin.status,
            wc_opcode::RECV_RDMA_WITH_IMM,
            fin.len,
            fin.imm,
        );
        out.push(wc);
    }
}

/// Write pending acknowledgements without blocking; a dead peer closes the connection.
fn flush_acks(c: &mut Conn) {
    match c.stream.flush_pending() {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
        Err(_) => {
            c.closed = true;
            return;
        }
    }
    while !c.acks.is_empty() {
        match c.stream.write(&c.acks) {
            Ok(0) => {
                c.closed = true;
                return;
            }
            Ok(n) => {
                c.acks.drain(..n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(_) => {
                c.closed = true;
                return;
            }
        }
    }
}

/// Acknowledgements read per `read` call at most: one probe hit announces each read's batch.
const ACKS_PER_READ: usize = 64;

fn ack_loop(
    mut s: AckReader,
    tx: SyncSender<Wc>,
    outstanding: Arc<Mutex<HashSet<u64>>>,
    alive: Arc<AtomicBool>,
    ctx: u64,
) {
    let mut buf = [0u8; ACK_LEN * ACKS_PER_READ];
    let mut have = 0;
    let mut wcs: Vec<Wc> = Vec::with_capacity(ACKS_PER_READ);
    'read: loop {
        debug_assert!(have < ACK_LEN);
        match s.read(&mut buf[have..]) {
            Ok(0) => break,
            Ok(k) => have += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        let whole = have / ACK_LEN * ACK_LEN;
        let mut bad = false;
        wcs.clear();
        for a in buf[..whole].chunks_exact(ACK_LEN) {
            let u32_at = |i: usize| u32::from_le_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
            if u32_at(0) != MAGIC_ACK {
                bad = true;
                break;
            }
            let mut w = [0u8; 8];
            w.copy_from_slice(&a[8..16]);
            let wr_id = u64::from_le_bytes(w);
            let wc = Wc::new(wr_id, u32_at(4), wc_opcode::RDMA_WRITE, u32_at(16), 0);
            let known = outstanding
                .lock()
                .map(|mut o| o.remove(&wr_id))
                .unwrap_or(false);
            if known {
                wcs.push(wc);
            }
        }
        abi::announce_completions(ctx, &wcs);
        for wc in wcs.drain(..) {
            if tx.send(wc).is_err() {
                return;
            }
        }
        if bad {
            break 'read;
        }
        buf.copy_within(whole..have, 0);
        have -= whole;
    }
    // Connection gone: everything still outstanding is flushed in error (never "completed").
    alive.store(false, Ordering::Release);
    let ids: Vec<u64> = outstanding
        .lock()
        .map(|mut o| o.drain().collect())
        .unwrap_or_default();
    let flushed: Vec<Wc> = ids
        .into_iter()
        .map(|wr_id| Wc::new(wr_id, wc_status::WR_FLUSH_ERR, wc_opcode::RDMA_WRITE, 0, 0))
        .collect();
    abi::announce_completions(ctx, &flushed);
    for wc in flushed {
        if tx.send(wc).is_err() {
            return;
        }
    }
}

impl KvTransport for TcpTransport {
    fn pair(&mut self) -> Result<Pairing, TransportError> {
        let t = self.target.as_mut().ok_or(TransportError::NotConnected)?;
        let p = Pairing::generate()?;
        let mut table =
            t.st.pairings
                .lock()
                .map_err(|_| TransportError::Auth("pairing table poisoned".into()))?;
        if table.len() >= MAX_PAIRINGS {
            return Err(TransportError::Auth(format!(
                "{MAX_PAIRINGS} pairings are live: unpair one first"
            )));
        }
        table.insert(p.id(), p.clone());
        Ok(p)
    }

    fn unpair(&mut self, pairing_id: u64) {
        let Some(t) = &mut self.target else { return };
        t.st.pairings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pairing_id);
        // Its keys refuse every write from now on, whatever path a frame takes (a held or
        // replayed one included). No proof is issued: the engine still asks `invalidate`.
        t.st.keys.retain(|_, e| e.pairing != pairing_id);
    }

    fn register(&mut self, len: u64, pairing_id: u64) -> Result<Region, TransportError> {
        let t = self.target.as_mut().ok_or(TransportError::NotConnected)?;
        if len > u64::from(u32::MAX) {
            return Err(TransportError::InvalidWr(format!(
                "region of {len} B exceeds 4 GiB"
            )));
        }
        let live =
            t.st.pairings
                .lock()
                .map(|table| table.contains_key(&pairing_id))
                .unwrap_or(false);
        if !live {
            return Err(TransportError::Auth(format!(
                "no live pairing {pairing_id:#018x} to register a region for"
            )));
        }
        let st = &mut t.st;
        if st.keys.len() >= MAX_LIVE_KEYS {
            return Err(TransportError::InvalidWr(format!(
                "{MAX_LIVE_KEYS} region keys are live: invalidate one first"
            )));
        }
        let rkey = st
            .key_seq
            .issue()
            .map_err(|e| TransportError::InvalidWr(e.to_string()))?;
        // 32 more random bits in the base (`hi << 32`, `len` < 4 GiB: `base + len` never
        // overflows): a write must name both, so a key is 64 unguessable bits.
        let base = u64::from(random_u32()?) << 32;
        st.keys.insert(
            rkey,
            KeyEntry {
                len,
                base,
                pairing: pairing_id,
            },
        );
        let region = Region { rkey, base, len };
        abi::custody_kv_register(self.ctx, rkey, region.base, len);
        Ok(region)
    }

    fn invalidate(&mut self, rkey: u32) -> Result<KeyInvalidated, TransportError> {
        let t = self.target.as_mut().ok_or(TransportError::NotConnected)?;
        // A key already invalidated (or dropped with its pairing) is no longer in the map but
        // was issued: invalidating it again proves the same thing.
        if t.st.keys.remove(&rkey).is_none() && !t.st.key_seq.was_issued(rkey) {
            return Err(TransportError::UnknownKey(rkey));
        }
        abi::custody_kv_invalidate(self.ctx, rkey);
        // Frames are read only on this thread (`poll_recv`), which re-checks the key before
        // every piece: from here on none of `rkey`'s bytes lands.
        Ok(KeyInvalidated::issued_by_transport(rkey))
    }

    unsafe fn post_write(&mut self, wr: &SendWr) -> Result<(), TransportError> {
        abi::custody_kv_post_write(self.ctx, wr);
        self.send_chain(wr)
    }

    fn poll_send(&mut self, out: &mut Vec<Wc>, max: usize) -> Result<usize, TransportError> {
        let mut n = 0;
        self.init.retired.retain(|rx| {
            loop {
                if n >= max {
                    return true;
                }
                match rx.try_recv() {
                    Ok(wc) => {
                        out.push(wc);
                        n += 1;
                    }
                    Err(TryRecvError::Empty) => return true,
                    Err(TryRecvError::Disconnected) => return false,
                }
            }
        });
        let Some(rx) = &self.init.completions else {
            return Err(TransportError::NotConnected);
        };
        while n < max {
            match rx.try_recv() {
                Ok(wc) => {
                    out.push(wc);
                    n += 1;
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        Ok(n)
    }

    fn poll_recv(
        &mut self,
        mem: &mut dyn TargetMemory,
        out: &mut Vec<Wc>,
        max: usize,
    ) -> Result<usize, TransportError> {
        let ctx = self.ctx;
        let t = self.target.as_mut().ok_or(TransportError::NotConnected)?;
        let announced = out.len();
        while let Ok(a) = t.st.new_conns.try_recv() {
            if t.conns.iter().filter(|c| c.pairing == a.pairing).count() >= MAX_CONNS_PER_PAIRING {
                t.st.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    pairing = a.pairing,
                    "KV transport: refused, the pairing has {MAX_CONNS_PER_PAIRING} live connections"
                );
                a.wire.shutdown();
                continue;
            }
            t.conns.push(Conn {
                id: a.id,
                pairing: a.pairing,
                stream: a.wire,
                hdr: [0; WR_HDR],
                hdr_got: 0,
                cur: None,
                acks: Vec::new(),
                closed: false,
            });
        }
        // A withdrawn pairing's connections go before another byte of theirs is read.
        {
            let table = t.st.pairings.lock().unwrap_or_else(|p| p.into_inner());
            for c in &mut t.conns {
                if !table.contains_key(&c.pairing) {
                    tracing::info!(
                        conn = c.id,
                        pairing = c.pairing,
                        "KV transport: pairing withdrawn, closing"
                    );
                    c.closed = true;
                }
            }
        }
        let mut n = 0;
        // Writes released from being held (fault injection) land first, judged now.
        while n < max
            && let Some(frame) = t.st.replay.pop_front()
        {
            n += 1;
            let status = land(&mut t.st, mem, &frame);
            let fin = Finished {
                opcode: frame.opcode,
                wr_id: frame.wr_id,
                imm: frame.imm,
                flags: frame.flags,
                len: frame.payload.len() as u32,
                status,
            };
            // A dead peer learns nothing; its writes were flushed on its side.
            if let Some(c) = t.conns.iter_mut().find(|c| c.id == frame.conn) {
                complete(&mut c.acks, &fin, out);
            } else {
                complete(&mut Vec::new(), &fin, out);
            }
        }
        let mut budget = t.st.poll_bytes_max;
        for c in &mut t.conns {
            // A peer that does not read its acknowledgements is not read either.
            while n < max && budget > 0 && !c.closed && c.acks.len() < ACKS_PENDING_MAX {
                match read_step(c, &mut t.st, mem, budget) {
                    Step::Progress(k) => budget = budget.saturating_sub(k),
                    Step::Done(k, fin) => {
                        budget = budget.saturating_sub(k);
                        if let Some(fin) = fin {
                            n += 1;
                            complete(&mut c.acks, &fin, out);
                        }
                    }
                    Step::Blocked => break,
                    Step::Closed => c.closed = true,
                }
            }
            flush_acks(c);
        }
        t.conns.retain(|c| {
            if c.closed {
                c.stream.shutdown();
            }
            !c.closed
        });
        // One probe hit for everything that landed in this call (after the landing, before the
        // caller learns of it).
        abi::announce_completions(ctx, &out[announced..]);
        Ok(n)
    }

    fn connected(&self) -> bool {
        self.init.stream.is_some() && self.init.alive.load(Ordering::Acquire)
    }

    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn endpoint(&self) -> String {
        self.local_addr().map(|a| a.to_string()).unwrap_or_default()
    }

    fn connect_peer(&mut self, peer: &str, pairing: &Pairing) -> Result<(), TransportError> {
        if peer.is_empty() {
            // The peer is an initiator: it dials this target.
            return Ok(());
        }
        let addr: SocketAddr = peer
            .parse()
            .map_err(|_| TransportError::BadEndpoint(peer.to_owned()))?;
        self.connect(addr, pairing)
    }

    fn target_stats(&self) -> TargetStats {
        TcpTransport::target_stats(self)
    }

    #[cfg(feature = "fault-injection")]
    fn fault_inject(&mut self, f: FaultInjection) -> Result<usize, TransportError> {
        match f {
            FaultInjection::CorruptNextPayload => self.fault_inject_corrupt_next_payload(),
            FaultInjection::HoldKey(k) => self.fault_inject_hold_key(k),
            FaultInjection::ReleaseHeld => return Ok(self.fault_inject_release_held()),
            FaultInjection::Disconnect => self.fault_inject_disconnect(),
        }
        Ok(0)
    }
}

/// Key and range checks, then the staged bytes land. Returns the `ibv_wc_status`.
fn land(t: &mut TargetState, mem: &mut dyn TargetMemory, f: &Frame) -> u32 {
    let Some(offset) = check_range(t, f.rkey, f.remote_addr, f.payload.len() as u64, f.pairing)
    else {
        t.stats.rejected_writes += 1;
        return wc_status::REM_ACCESS_ERR;
    };
    match mem.write(f.rkey, offset, &f.payload) {
        Ok(()) => {
            t.stats.landed_writes += 1;
            t.stats.landed_bytes += f.payload.len() as u64;
            wc_status::SUCCESS
        }
        Err(e) => {
            tracing::warn!(rkey = f.rkey, offset, error = %e, "KV write refused by target memory");
            t.stats.rejected_writes += 1;
            wc_status::REM_ACCESS_ERR
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::Sge;

    #[derive(Default)]
    struct Mem {
        bytes: HashMap<u32, Vec<u8>>,
    }
    impl TargetMemory for Mem {
        fn write(&mut self, rkey: u32, offset: u64, b: &[u8]) -> Result<(), crate::AccessError> {
            let m = self.bytes.entry(rkey).or_insert_with(|| vec![0; 1024]);
            m[offset as usize..offset as usize + b.len()].copy_from_slice(b);
            Ok(())
        }
    }

    /// Memory with direct landing, handing out destinations of at most `piece` bytes (so that a
    /// write lands in many pieces).
    struct DirectMem {
        bytes: Vec<u8>,
        piece: usize,
        done: Vec<(u32, u64, u64)>,
    }
    impl TargetMemory for DirectMem {
        fn write(&mut self, _rkey: u32, offset: u64, b: &[u8]) -> Result<(), crate::AccessError> {
            self.bytes[offset as usize..offset as usize + b.len()].copy_from_slice(b);
            Ok(())
        }
        fn direct(&self) -> bool {
            true
        }
        fn dest(
            &mut self,
            _rkey: u32,
            offset: u64,
            max_len: usize,
        ) -> Result<&mut [u8], crate::AccessError> {
            let n = max_len.min(self.piece);
            Ok(&mut self.bytes[offset as usize..offset as usize + n])
        }
        fn dest_done(
            &mut self,
            rkey: u32,
            offset: u64,
            len: u64,
        ) -> Result<(), crate::AccessError> {
            self.done.push((rkey, offset, len));
            Ok(())
        }
    }

    /// The gather list of one write of all of `b`.
    fn one_sge(b: &[u8]) -> [Sge; 1] {
        [Sge {
            addr: b.as_ptr() as u64,
            length: b.len() as u32,
            lkey: 0,
        }]
    }

    /// A target and an initiator connected under a fresh pairing (its id last).
    fn pair() -> (TcpTransport, TcpTransport, u64) {
        let mut target = TcpTransport::new(2);
        let addr = target
            .listen("127.0.0.1:0".parse().expect("addr"))
            .expect("listen");
        let pairing = target.pair().expect("pair");
        let mut init = TcpTransport::new(1);
        init.connect(addr, &pairing).expect("connect");
        (init, target, pairing.id())
    }

    fn pump(
        init: &mut TcpTransport,
        target: &mut TcpTransport,
        mem: &mut Mem,
        want_send: usize,
    ) -> (Vec<Wc>, Vec<Wc>) {
        let (mut s, mut r) = (Vec::new(), Vec::new());
        for _ in 0..2000 {
            target.poll_recv(mem, &mut r, 64).expect("recv");
            init.poll_send(&mut s, 64).expect("send");
            if s.len() >= want_send {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        (s, r)
    }

    /// Safety property 2's key half at scale: a million regions registered and invalidated on
    /// one target get a million distinct keys, the target's key memory stays at the live keys
    /// (here one), and an invalidated key stays known (a second invalidate proves it again)
    /// while a key never issued does not.
    #[test]
    fn a_million_keys_are_distinct_and_the_registry_stays_bounded() {
        const N: usize = 1_000_000;
        let (_init, mut target, p) = pair();
        let mut seen = HashSet::with_capacity(N);
        let mut last = 0;
        for _ in 0..N {
            let region = target.register(64, p).expect("register");
            assert!(seen.insert(region.rkey), "key {:#x} reused", region.rkey);
            let live = target.target.as_ref().map_or(0, |t| t.st.keys.len());
            assert_eq!(live, 1, "only the live key is held");
            let _proof = target.invalidate(region.rkey).expect("invalidate");
            last = region.rkey;
        }
        let st = &target.target.as_ref().expect("target").st;
        assert!(st.keys.is_empty());
        assert!(
            st.keys.capacity() <= 16,
            "the key map never grew: capacity {}",
            st.keys.capacity()
        );
        let _proof = target.invalidate(last).expect("an issued key stays known");
        let never = (1..=u32::MAX)
            .find(|k| !seen.contains(k))
            .expect("a key not issued");
        assert!(matches!(
            target.invalidate(never),
            Err(TransportError::UnknownKey(_))
        ));
    }

    #[test]
    fn write_with_imm_lands_and_completes_then_invalidate_refuses() {
        let (mut init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        let data = [7u8; 100];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(42, &sge, region.base + 10, region.rkey).with_imm(5);
        // SAFETY: `data` outlives the completion polled below.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s.len(), 1);
        assert!(s[0].ok() && s[0].wr_id == 42);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].imm(), 5);
        assert_eq!(&mem.bytes[&region.rkey][10..110], &data[..]);

        let _proof = target.invalidate(region.rkey).expect("invalidate");
        let data2 = [9u8; 100];
        let sge = one_sge(&data2);
        let wr = SendWr::rdma_write(43, &sge, region.base + 10, region.rkey).with_imm(6);
        // SAFETY: as above.
        unsafe { init.post_write(&wr) }.expect("post");
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(r.is_empty());
        assert_eq!(
            &mem.bytes[&region.rkey][10..110],
            &data[..],
            "nothing landed after invalidate"
        );
        assert_eq!(target.target_stats().rejected_writes, 1);
    }

    #[test]
    fn direct_landing_reads_straight_into_memory_in_pieces() {
        let (mut init, mut target, p) = pair();
        let region = target.register(1 << 20, p).expect("register");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(1, &sge, region.base + 100, region.rkey).with_imm(3);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = DirectMem {
            bytes: vec![0; 1 << 20],
            piece: 4093,
            done: Vec::new(),
        };
        let (mut s, mut r) = (Vec::new(), Vec::new());
        for _ in 0..5000 {
            target.poll_recv(&mut mem, &mut r, 64).expect("recv");
            init.poll_send(&mut s, 64).expect("send");
            if !s.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(s[0].ok(), "{:?}", s[0]);
        assert_eq!(r.len(), 1);
        assert_eq!(&mem.bytes[100..100 + data.len()], &data[..]);
        assert_eq!(mem.done, vec![(region.rkey, 100, data.len() as u64)]);
        assert_eq!(target.target_stats().landed_bytes, data.len() as u64);
    }

    /// A chain of several pages' writes (one post, well over WRITE_BYTES_GROUP: written in
    /// pieces) lands in order, every page's imm write completes on both sides, and the bytes
    /// are the posted ones.
    #[test]
    fn a_long_chain_streams_in_pieces_and_lands_every_page() {
        let (mut init, mut target, p) = pair();
        const PAGES: usize = 6;
        const PAGE: usize = 100_000;
        let region = target.register((PAGES * PAGE) as u64, p).expect("register");
        let data: Vec<u8> = (0..PAGES * PAGE).map(|i| (i * 13 % 251) as u8).collect();
        // Per page: two halves (unsignaled), then a signaled imm write of its last 8 bytes.
        let sges: Vec<Sge> = (0..PAGES)
            .flat_map(|p| {
                let base = data.as_ptr() as u64 + (p * PAGE) as u64;
                [(0, PAGE / 2), (PAGE / 2, PAGE / 2 - 8), (PAGE - 8, 8)].map(|(off, len)| Sge {
                    addr: base + off as u64,
                    length: len as u32,
                    lkey: 0,
                })
            })
            .collect();
        let mut wrs: Vec<SendWr> = sges
            .iter()
            .enumerate()
            .map(|(k, sge)| {
                let (p, part) = (k / 3, k % 3);
                let off = sge.addr - data.as_ptr() as u64;
                let wr = SendWr::rdma_write(
                    p as u64,
                    std::slice::from_ref(sge),
                    region.base + off,
                    region.rkey,
                );
                if part == 2 { wr.with_imm(p as u32) } else { wr }
            })
            .collect();
        for k in 0..wrs.len() - 1 {
            let next: *const SendWr = &wrs[k + 1];
            wrs[k].next = next;
        }
        // SAFETY: `data`, `sges` and `wrs` outlive the completions polled below.
        unsafe { init.post_write(&wrs[0]) }.expect("one post");
        let mut mem = Mem::default();
        mem.bytes.insert(region.rkey, vec![0; PAGES * PAGE]);
        let (s, r) = pump(&mut init, &mut target, &mut mem, PAGES);
        assert_eq!(s.len(), PAGES, "one send completion per signaled write");
        assert!(s.iter().all(Wc::ok));
        let mut ids: Vec<u64> = s.iter().map(|w| w.wr_id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..PAGES as u64).collect::<Vec<_>>());
        let imms: Vec<u32> = r.iter().map(Wc::imm).collect();
        assert_eq!(imms, (0..PAGES as u32).collect::<Vec<_>>(), "in order");
        assert_eq!(&mem.bytes[&region.rkey][..PAGES * PAGE], &data[..]);
    }

    #[test]
    fn invalidation_mid_write_stops_the_rest_from_landing() {
        let (mut init, mut target, p) = pair();
        target.set_poll_bytes_max(1000);
        let region = target.register(1 << 20, p).expect("register");
        let data = vec![0xabu8; 200_000];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(5, &sge, region.base, region.rkey).with_imm(0);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = DirectMem {
            bytes: vec![0; 1 << 20],
            piece: 1 << 20,
            done: Vec::new(),
        };
        let mut r = Vec::new();
        // Poll until some, but not all, of the payload landed.
        for _ in 0..5000 {
            target.poll_recv(&mut mem, &mut r, 64).expect("recv");
            if mem.bytes[0] == 0xab {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let landed_before = mem.bytes.iter().filter(|&&b| b == 0xab).count();
        assert!(
            landed_before > 0 && landed_before <= 1000,
            "{landed_before}"
        );
        let _proof = target.invalidate(region.rkey).expect("invalidate");
        target.set_poll_bytes_max(1 << 20);
        let (mut s, mut r) = (Vec::new(), Vec::new());
        for _ in 0..5000 {
            target.poll_recv(&mut mem, &mut r, 64).expect("recv");
            init.poll_send(&mut s, 64).expect("send");
            if !s.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(r.is_empty());
        assert_eq!(
            mem.bytes.iter().filter(|&&b| b == 0xab).count(),
            landed_before,
            "not one byte landed after invalidate returned"
        );
        assert!(mem.done.is_empty());
        assert_eq!(target.target_stats().rejected_writes, 1);
    }

    #[test]
    fn out_of_range_write_is_refused() {
        let (mut init, mut target, p) = pair();
        let region = target.register(64, p).expect("register");
        let data = [1u8; 100];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(1, &sge, region.base, region.rkey).with_imm(0);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(r.is_empty() && mem.bytes.is_empty());
    }

    #[test]
    fn held_writes_delivered_after_invalidation_do_not_land() {
        let (mut init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        target.fault_inject_hold_key(region.rkey);
        let data = [3u8; 16];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(1, &sge, region.base, region.rkey).with_imm(0);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        let mut r = Vec::new();
        for _ in 0..2000 {
            target.poll_recv(&mut mem, &mut r, 64).expect("recv");
            if target.target.as_ref().is_some_and(|t| t.st.held.len() == 1) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _proof = target.invalidate(region.rkey).expect("invalidate");
        assert_eq!(target.fault_inject_release_held(), 1);
        let (s, _) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(mem.bytes.is_empty());
    }

    #[test]
    fn lost_connection_flushes_outstanding_writes_in_error() {
        let (mut init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        target.fault_inject_hold_key(region.rkey); // never acknowledged
        let data = [3u8; 16];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(9, &sge, region.base, region.rkey).with_imm(0);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        init.fault_inject_disconnect();
        let mut mem = Mem::default();
        let (s, _) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].status, wc_status::WR_FLUSH_ERR);
        assert!(!init.connected());
    }

    /// One raw frame as the wire format defines it: a write of `payload` at `addr` with `rkey`.
    fn raw_frame(rkey: u32, addr: u64, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::with_capacity(WR_HDR + payload.len());
        f.extend_from_slice(&MAGIC_WR.to_le_bytes());
        f.extend_from_slice(&WR_RDMA_WRITE_WITH_IMM.to_le_bytes());
        f.extend_from_slice(&77u64.to_le_bytes());
        f.extend_from_slice(&addr.to_le_bytes());
        f.extend_from_slice(&rkey.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&SEND_SIGNALED.to_le_bytes());
        f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Poll until `refused` connections were counted (the acceptor's threads are asynchronous).
    fn poll_until_refused(target: &mut TcpTransport, mem: &mut Mem, refused: u64) {
        for _ in 0..5000 {
            target.poll_recv(mem, &mut Vec::new(), 64).expect("recv");
            if target.target_stats().refused_connections >= refused {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!(
            "{refused} refused connections never counted: {:?}",
            target.target_stats()
        );
    }

    #[test]
    fn a_raw_client_with_a_stolen_key_lands_nothing_and_is_disconnected() {
        let (_init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        let addr = target.local_addr().expect("listening");
        // The key and base are stolen (known exactly); the connection proves no pairing.
        let mut raw = TcpStream::connect(addr).expect("connect");
        use std::io::Write as _;
        raw.write_all(&raw_frame(region.rkey, region.base, &[0xAB; 512]))
            .expect("send");
        let mut mem = Mem::default();
        poll_until_refused(&mut target, &mut mem, 1);
        assert!(mem.bytes.is_empty(), "nothing landed");
        let st = target.target_stats();
        assert_eq!((st.landed_writes, st.landed_bytes), (0, 0), "{st:?}");
        // Disconnected: the target closed the socket (EOF or reset, never an acknowledgement).
        raw.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        match raw.read(&mut buf) {
            Ok(0) | Err(_) => {}
            Ok(n) => panic!("the target answered {n} bytes to an unauthenticated frame"),
        }
        // A connection that says nothing and leaves is a probe, not a refusal.
        drop(TcpStream::connect(addr).expect("connect"));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(target.target_stats().refused_connections, 1);
    }

    #[test]
    fn a_key_of_another_pairing_refuses_the_write() {
        let (mut init, mut target, p) = pair();
        let mine = target.register(1024, p).expect("register");
        // A second, authenticated initiator of another pairing writes with the first's key.
        let other = target.pair().expect("pair");
        let mut intruder = TcpTransport::new(3);
        intruder
            .connect(target.local_addr().expect("addr"), &other)
            .expect("connect");
        let data = [5u8; 64];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(1, &sge, mine.base, mine.rkey).with_imm(1);
        // SAFETY: `data` outlives the completion polled below.
        unsafe { intruder.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        let (s, r) = pump(&mut intruder, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(r.is_empty() && mem.bytes.is_empty());
        // The rightful initiator's write with the same key lands.
        // SAFETY: as above.
        unsafe { init.post_write(&wr) }.expect("post");
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert!(s[0].ok() && r.len() == 1);
        assert_eq!(&mem.bytes[&mine.rkey][..64], &data[..]);
    }

    #[test]
    fn a_wrong_secret_or_a_withdrawn_pairing_gets_no_connection() {
        let (init, mut target, p) = pair();
        let addr = target.local_addr().expect("addr");
        let forged = Pairing::from_parts(p, &[0u8; 32]).expect("parts");
        let mut intruder = TcpTransport::new(3);
        let e = intruder.connect(addr, &forged).expect_err("forged secret");
        assert!(matches!(e, TransportError::Auth(_)), "{e}");
        let mut mem = Mem::default();
        poll_until_refused(&mut target, &mut mem, 1);
        // Withdrawing the pairing closes its live connection: its next write fails.
        target.unpair(p);
        target
            .poll_recv(&mut mem, &mut Vec::new(), 64)
            .expect("recv");
        assert!(
            target.register(64, p).is_err(),
            "no region for a withdrawn pairing"
        );
        for _ in 0..2000 {
            if !init.connected() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(!init.connected());
    }

    #[test]
    fn keys_are_random_and_never_reused() {
        let (_init, mut target, p) = pair();
        let mut seen = HashSet::new();
        let mut bases = HashSet::new();
        for _ in 0..2000 {
            let r = target.register(64, p).expect("register");
            assert!(seen.insert(r.rkey), "key {:#x} reused", r.rkey);
            bases.insert(r.base);
            let _proof = target.invalidate(r.rkey).expect("invalidate");
        }
        // Random, not a counter: consecutive keys are not neighbours, bases vary.
        assert!(bases.len() > 1900);
        let mut keys: Vec<u32> = seen.into_iter().collect();
        keys.sort_unstable();
        assert!(keys.windows(2).filter(|w| w[1] == w[0] + 1).count() < 10);
    }

    #[test]
    fn a_valid_hello_with_a_wrong_proof_lands_nothing() {
        let (_init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        let mut raw = TcpStream::connect(target.local_addr().expect("addr")).expect("connect");
        use std::io::Write as _;
        let mut hello = Vec::new();
        hello.extend_from_slice(&0x4b56_4849u32.to_le_bytes()); // "KVHI"
        hello.extend_from_slice(&1u32.to_le_bytes());
        hello.extend_from_slice(&p.to_le_bytes()); // the live pairing's id (ids are not secret)
        hello.extend_from_slice(&[9u8; 32]);
        raw.write_all(&hello).expect("hello");
        let mut ch = [0u8; 72];
        raw.read_exact(&mut ch).expect("challenge");
        let mut proof = Vec::new();
        proof.extend_from_slice(&0x4b56_5052u32.to_le_bytes()); // "KVPR"
        proof.extend_from_slice(&1u32.to_le_bytes());
        proof.extend_from_slice(&[0u8; 32]);
        raw.write_all(&proof).expect("proof");
        raw.write_all(&raw_frame(region.rkey, region.base, &[0xAB; 256]))
            .discard("the target may close the connection before the whole frame is written");
        let mut mem = Mem::default();
        poll_until_refused(&mut target, &mut mem, 1);
        for _ in 0..50 {
            target
                .poll_recv(&mut mem, &mut Vec::new(), 64)
                .expect("recv");
        }
        assert!(mem.bytes.is_empty(), "nothing landed");
        assert_eq!(target.target_stats().landed_writes, 0);
    }

    #[test]
    fn a_withdrawn_pairings_held_writes_do_not_land() {
        let (mut init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        target.fault_inject_hold_key(region.rkey);
        let data = [4u8; 32];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(5, &sge, region.base, region.rkey).with_imm(1);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        for _ in 0..2000 {
            target
                .poll_recv(&mut mem, &mut Vec::new(), 64)
                .expect("recv");
            if !target.target.as_ref().expect("target").st.held.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        target.unpair(p);
        assert_eq!(target.fault_inject_release_held(), 1);
        let mut r = Vec::new();
        target.poll_recv(&mut mem, &mut r, 64).expect("recv");
        assert!(
            r.is_empty() && mem.bytes.is_empty(),
            "a withdrawn pairing's write landed"
        );
        assert_eq!(target.target_stats().rejected_writes, 1);
    }

    #[test]
    fn the_right_rkey_with_a_wrong_base_is_refused() {
        let (mut init, mut target, p) = pair();
        let region = target.register(1024, p).expect("register");
        let data = [6u8; 16];
        let sge = one_sge(&data);
        let wr = SendWr::rdma_write(8, &sge, region.base ^ (1 << 40), region.rkey).with_imm(2);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(r.is_empty() && mem.bytes.is_empty());
    }

    #[test]
    fn a_trickling_or_crowding_peer_cannot_hold_the_gate() {
        let (_init, mut target, _p) = pair();
        let addr = target.local_addr().expect("addr");
        let mut mem = Mem::default();
        // Crowding: the per-peer cap refuses the next connection at once.
        let silent: Vec<TcpStream> = (0..MAX_AUTHENTICATING_PER_PEER)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let before = target.target_stats().refused_connections;
        let _extra = TcpStream::connect(addr).expect("connect");
        poll_until_refused(&mut target, &mut mem, before + 1);
        drop(silent);
        // Trickling: one byte a second is cut at the overall deadline, not extended per read.
        std::thread::sleep(std::time::Duration::from_millis(200));
        let before = target.target_stats().refused_connections;
        let mut slow = TcpStream::connect(addr).expect("connect");
        let t0 = std::time::Instant::now();
        use std::io::Write as _;
        let mut cut = false;
        for b in 0x4b56_4849u32.to_le_bytes().iter().cycle().take(12) {
            if slow.write_all(&[*b]).is_err() {
                cut = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(900));
            if target.target_stats().refused_connections > before {
                cut = true;
                break;
            }
        }
        assert!(cut, "a trickling peer was never cut");
        assert!(
            t0.elapsed() < AUTH_TIMEOUT + std::time::Duration::from_secs(2),
            "cut only after {:?}",
            t0.elapsed()
        );
    }
}
