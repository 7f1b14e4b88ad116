//! `tcp`: the one-sided-write transport in software over TCP, for machines without RDMA.
//!
//! Wire format (little-endian). Initiator → target, one frame per work request:
//! `magic u32 | opcode u32 | wr_id u64 | remote_addr u64 | rkey u32 | imm (host order) u32 |
//! flags u32 | len u32 | payload[len]` (40-byte header). Target → initiator, one acknowledgement
//! per *signaled* work request: `magic u32 | status u32 | wr_id u64 | byte_len u32 | pad u32`.
//!
//! Threads: the target has an acceptor and one reader per connection; readers only parse frames
//! into a bounded queue (so a slow target pushes back on the sender through TCP) — bytes land
//! only in [`KvTransport::poll_recv`] on the caller's thread, after the key and range checks.
//! The initiator has one reader for acknowledgements; when the connection drops, every
//! outstanding signaled work request completes with `WR_FLUSH_ERR` (as a verbs QP in error).
//!
//! Fault injection (tests only, named as such): corrupting a payload in flight, holding a key's
//! writes back to deliver them late, cutting the connection.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::sync::{Arc, Mutex};

use super::abi::{
    self, SEND_SIGNALED, SendWr, WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, Wc, wc_opcode, wc_status,
};
use super::{KvTransport, Region, TargetMemory, TransportError};

const MAGIC_WR: u32 = 0x4b56_5752; // "KVWR"
const MAGIC_ACK: u32 = 0x4b56_4143; // "KVAC"
const WR_HDR: usize = 40;
const ACK_LEN: usize = 24;
/// Largest single write accepted (bounds a reader's allocation).
pub const MAX_WRITE_BYTES: u32 = 64 << 20;
/// Longest work-request chain accepted in one post (bounds the walk).
pub const MAX_CHAIN: usize = 4096;
/// Frames parsed but not yet landed, per target (the bounded queue).
const RECV_QUEUE_FRAMES: usize = 8192;
/// Base address of region `k`: keys are spread over the address space so that an address
/// names its key (`base = k << 32`), as distinct registrations have distinct addresses in verbs.
const fn region_base(rkey: u32) -> u64 {
    (rkey as u64) << 32
}

#[derive(Debug)]
struct Frame {
    conn: u64,
    opcode: u32,
    wr_id: u64,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
    flags: u32,
    payload: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyEntry {
    Valid { len: u64 },
    Invalidated,
}

/// Counters of the target side.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TargetStats {
    pub landed_writes: u64,
    pub landed_bytes: u64,
    /// Writes refused because their key was invalidated or unknown.
    pub rejected_writes: u64,
}

#[derive(Debug, Default)]
struct Initiator {
    stream: Option<TcpStream>,
    completions: Option<Receiver<Wc>>,
    /// Completion queues of earlier (lost) connections, drained until their readers finish:
    /// their flush errors must reach the caller after a reconnect.
    retired: Vec<Receiver<Wc>>,
    outstanding: Arc<Mutex<HashSet<u64>>>,
    alive: Arc<AtomicBool>,
}

/// Payload buffers returned after landing, reused by the readers: a fresh large allocation per
/// frame would cost page faults and kernel zeroing on every write.
type Spares = Arc<Mutex<Vec<Vec<u8>>>>;
/// Buffers kept for reuse (bounds the pool's memory).
const MAX_SPARES: usize = 256;

#[derive(Debug)]
struct Target {
    frames: Receiver<Frame>,
    spares: Spares,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    keys: HashMap<u32, KeyEntry>,
    next_key: u32,
    stats: TargetStats,
    local_addr: SocketAddr,
    /// Frames held back by fault injection, delivered by `fault_inject_release_held`.
    held: VecDeque<Frame>,
    hold_keys: HashSet<u32>,
    replay: VecDeque<Frame>,
    corrupt_next: bool,
}

/// The TCP transport. A node calls [`TcpTransport::listen`] (target) or
/// [`TcpTransport::connect`] (initiator), or both.
#[derive(Debug)]
pub struct TcpTransport {
    ctx: u64,
    init: Initiator,
    target: Option<Target>,
    iov_scratch: Vec<u8>,
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

impl TcpTransport {
    pub fn new(node: u32) -> Self {
        Self {
            ctx: abi::new_ctx(node),
            init: Initiator::default(),
            target: None,
            iov_scratch: Vec::new(),
        }
    }

    /// The probe context of this instance.
    pub fn ctx(&self) -> u64 {
        self.ctx
    }

    /// Become a target listening on `addr` (port 0 = any). Returns the bound address.
    pub fn listen(&mut self, addr: SocketAddr) -> Result<SocketAddr, TransportError> {
        let listener = TcpListener::bind(addr)?;
        let local_addr = listener.local_addr()?;
        let (tx, rx) = sync_channel::<Frame>(RECV_QUEUE_FRAMES);
        let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
        let conns_acc = Arc::clone(&conns);
        let spares: Spares = Arc::default();
        let spares_acc = Arc::clone(&spares);
        std::thread::Builder::new()
            .name("kv-tcp-accept".into())
            .spawn(move || accept_loop(listener, tx, conns_acc, spares_acc))?;
        self.target = Some(Target {
            frames: rx,
            spares,
            conns,
            keys: HashMap::new(),
            next_key: 1,
            stats: TargetStats::default(),
            local_addr,
            held: VecDeque::new(),
            hold_keys: HashSet::new(),
            replay: VecDeque::new(),
            corrupt_next: false,
        });
        Ok(local_addr)
    }

    /// The target's listening address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.target.as_ref().map(|t| t.local_addr)
    }

    /// Become an initiator connected to the target at `addr`.
    pub fn connect(&mut self, addr: SocketAddr) -> Result<(), TransportError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        set_socket_buffers(&stream);
        let reader = stream.try_clone()?;
        let (tx, rx) = sync_channel::<Wc>(RECV_QUEUE_FRAMES);
        let outstanding: Arc<Mutex<HashSet<u64>>> = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let (out2, alive2, ctx) = (Arc::clone(&outstanding), Arc::clone(&alive), self.ctx);
        std::thread::Builder::new()
            .name("kv-tcp-acks".into())
            .spawn(move || ack_loop(reader, tx, out2, alive2, ctx))?;
        let mut retired = std::mem::take(&mut self.init.retired);
        retired.extend(self.init.completions.take());
        if let Some(old) = self.init.stream.take() {
            let _ = old.shutdown(Shutdown::Both);
        }
        self.init = Initiator {
            stream: Some(stream),
            completions: Some(rx),
            retired,
            outstanding,
            alive,
        };
        Ok(())
    }

    pub fn target_stats(&self) -> TargetStats {
        self.target.as_ref().map(|t| t.stats).unwrap_or_default()
    }

    /// Whether `rkey` is registered and valid.
    pub fn key_valid(&self, rkey: u32) -> bool {
        self.target
            .as_ref()
            .is_some_and(|t| matches!(t.keys.get(&rkey), Some(KeyEntry::Valid { .. })))
    }

    /// Fault injection: flip one byte of the next payload that lands (corruption in flight that
    /// TCP's own checksum would not catch, e.g. a buggy NIC or memory error).
    pub fn fault_inject_corrupt_next_payload(&mut self) {
        if let Some(t) = &mut self.target {
            t.corrupt_next = true;
        }
    }

    /// Fault injection: hold back every arriving write of `rkey` (a delayed packet).
    pub fn fault_inject_hold_key(&mut self, rkey: u32) {
        if let Some(t) = &mut self.target {
            t.hold_keys.insert(rkey);
        }
    }

    /// Fault injection: deliver every held write at the next `poll_recv` (late, possibly after
    /// the key was invalidated and the pages reallocated). Returns how many.
    pub fn fault_inject_release_held(&mut self) -> usize {
        let Some(t) = &mut self.target else { return 0 };
        t.hold_keys.clear();
        let n = t.held.len();
        t.replay.extend(t.held.drain(..));
        n
    }

    /// Fault injection: cut the initiator's connection abruptly.
    pub fn fault_inject_disconnect(&mut self) {
        if let Some(s) = &self.init.stream {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn send_chain(&mut self, first: &SendWr) -> Result<(), TransportError> {
        let Some(stream) = self.init.stream.as_mut() else {
            return Err(TransportError::NotConnected);
        };
        if !self.init.alive.load(Ordering::Acquire) {
            return Err(TransportError::Disconnected);
        }
        // Validate the whole chain before anything goes on the wire: a post is all or nothing.
        let mut wr: *const SendWr = first;
        let mut n = 0;
        while !wr.is_null() {
            n += 1;
            if n > MAX_CHAIN {
                return Err(TransportError::InvalidWr(format!(
                    "chain longer than {MAX_CHAIN}"
                )));
            }
            // SAFETY: the caller of `post_write` guarantees the chain's pointers are valid.
            let w = unsafe { &*wr };
            if w.opcode != WR_RDMA_WRITE && w.opcode != WR_RDMA_WRITE_WITH_IMM {
                return Err(TransportError::InvalidWr(format!("opcode {}", w.opcode)));
            }
            if w.num_sge < 0 || (w.num_sge > 0 && w.sg_list.is_null()) {
                return Err(TransportError::InvalidWr("bad scatter/gather list".into()));
            }
            wr = w.next;
        }
        let mut wr: *const SendWr = first;
        let mut signaled = Vec::new();
        while !wr.is_null() {
            // SAFETY: validated above; see `post_write`.
            let w = unsafe { &*wr };
            // SAFETY: `num_sge` entries at `sg_list` (validated non-null when num_sge > 0).
            let sges = unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) };
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
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(1 + sges.len());
            iov.push(IoSlice::new(&hdr));
            for s in sges {
                // SAFETY: the caller guarantees each SGE names `length` readable bytes.
                let bytes =
                    unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                iov.push(IoSlice::new(bytes));
            }
            if w.send_flags & SEND_SIGNALED != 0 {
                signaled.push(w.wr_id);
                if let Ok(mut o) = self.init.outstanding.lock() {
                    o.insert(w.wr_id);
                }
            }
            if let Err(e) = write_all_vectored(stream, &mut iov) {
                self.init.alive.store(false, Ordering::Release);
                let _ = stream.shutdown(Shutdown::Both);
                return Err(e.into());
            }
            wr = w.next;
        }
        let _ = &self.iov_scratch;
        Ok(())
    }
}

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

fn write_all_vectored(s: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn accept_loop(
    listener: TcpListener,
    tx: SyncSender<Frame>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    spares: Spares,
) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        set_socket_buffers(&stream);
        let conn = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let Ok(writer) = stream.try_clone() else {
            continue;
        };
        if let Ok(mut c) = conns.lock() {
            c.insert(conn, writer);
        }
        let (tx, conns, spares) = (tx.clone(), Arc::clone(&conns), Arc::clone(&spares));
        let spawned = std::thread::Builder::new()
            .name("kv-tcp-recv".into())
            .spawn(move || {
                let _ = read_frames(stream, conn, &tx, &spares);
                if let Ok(mut c) = conns.lock() {
                    c.remove(&conn);
                }
            });
        if spawned.is_err() {
            tracing::error!("cannot spawn a KV transport reader thread");
        }
    }
}

fn read_frames(
    mut s: TcpStream,
    conn: u64,
    tx: &SyncSender<Frame>,
    spares: &Spares,
) -> std::io::Result<()> {
    let mut hdr = [0u8; WR_HDR];
    loop {
        s.read_exact(&mut hdr)?;
        let u32_at = |i: usize| u32::from_le_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&hdr[i..i + 8]);
            u64::from_le_bytes(b)
        };
        if u32_at(0) != MAGIC_WR {
            tracing::warn!(
                conn,
                "KV transport: bad frame magic, closing the connection"
            );
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let len = u32_at(36);
        if len > MAX_WRITE_BYTES {
            tracing::warn!(
                conn,
                len,
                "KV transport: oversized frame, closing the connection"
            );
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let mut payload = spares
            .lock()
            .ok()
            .and_then(|mut v| v.pop())
            .unwrap_or_default();
        payload.clear();
        payload.resize(len as usize, 0);
        s.read_exact(&mut payload)?;
        let frame = Frame {
            conn,
            opcode: u32_at(4),
            wr_id: u64_at(8),
            remote_addr: u64_at(16),
            rkey: u32_at(24),
            imm: u32_at(28),
            flags: u32_at(32),
            payload,
        };
        if tx.send(frame).is_err() {
            return Ok(()); // the transport is gone
        }
    }
}

fn ack_loop(
    mut s: TcpStream,
    tx: SyncSender<Wc>,
    outstanding: Arc<Mutex<HashSet<u64>>>,
    alive: Arc<AtomicBool>,
    ctx: u64,
) {
    let mut buf = [0u8; ACK_LEN];
    while s.read_exact(&mut buf).is_ok() {
        let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        if u32_at(0) != MAGIC_ACK {
            break;
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&buf[8..16]);
        let wr_id = u64::from_le_bytes(w);
        let wc = Wc::new(wr_id, u32_at(4), wc_opcode::RDMA_WRITE, u32_at(16), 0);
        let known = outstanding
            .lock()
            .map(|mut o| o.remove(&wr_id))
            .unwrap_or(false);
        if known {
            abi::custody_kv_complete(ctx, &wc);
            if tx.send(wc).is_err() {
                return;
            }
        }
    }
    // Connection gone: everything still outstanding is flushed in error (never "completed").
    alive.store(false, Ordering::Release);
    let ids: Vec<u64> = outstanding
        .lock()
        .map(|mut o| o.drain().collect())
        .unwrap_or_default();
    for wr_id in ids {
        let wc = Wc::new(wr_id, wc_status::WR_FLUSH_ERR, wc_opcode::RDMA_WRITE, 0, 0);
        abi::custody_kv_complete(ctx, &wc);
        if tx.send(wc).is_err() {
            return;
        }
    }
}

impl KvTransport for TcpTransport {
    fn register(&mut self, len: u64) -> Result<Region, TransportError> {
        let t = self.target.as_mut().ok_or(TransportError::NotConnected)?;
        if len > u64::from(u32::MAX) {
            return Err(TransportError::InvalidWr(format!(
                "region of {len} B exceeds 4 GiB"
            )));
        }
        // Keys are never reused within a transport's life, so a late write of an old key can
        // never match a new registration.
        let rkey = t.next_key;
        t.next_key = t
            .next_key
            .checked_add(1)
            .ok_or_else(|| TransportError::InvalidWr("key space exhausted".into()))?;
        t.keys.insert(rkey, KeyEntry::Valid { len });
        let region = Region {
            rkey,
            base: region_base(rkey),
            len,
        };
        abi::custody_kv_register(self.ctx, rkey, region.base, len);
        Ok(region)
    }

    fn invalidate(&mut self, rkey: u32) -> Result<(), TransportError> {
        let t = self.target.as_mut().ok_or(TransportError::NotConnected)?;
        match t.keys.get_mut(&rkey) {
            Some(e) => *e = KeyEntry::Invalidated,
            None => return Err(TransportError::UnknownKey(rkey)),
        }
        abi::custody_kv_invalidate(self.ctx, rkey);
        Ok(())
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
        let mut n = 0;
        while n < max {
            let frame = match t.replay.pop_front() {
                Some(f) => f,
                None => match t.frames.try_recv() {
                    Ok(f) => f,
                    Err(_) => break,
                },
            };
            if t.hold_keys.contains(&frame.rkey) {
                t.held.push_back(frame);
                continue;
            }
            n += 1;
            let mut frame = frame;
            if t.corrupt_next && !frame.payload.is_empty() {
                t.corrupt_next = false;
                let i = frame.payload.len() / 2;
                frame.payload[i] ^= 0x40;
            }
            let status = land(t, mem, &frame);
            let len = frame.payload.len() as u32;
            if frame.flags & SEND_SIGNALED != 0 {
                let mut ack = [0u8; ACK_LEN];
                ack[0..4].copy_from_slice(&MAGIC_ACK.to_le_bytes());
                ack[4..8].copy_from_slice(&status.to_le_bytes());
                ack[8..16].copy_from_slice(&frame.wr_id.to_le_bytes());
                ack[16..20].copy_from_slice(&len.to_le_bytes());
                if let Ok(mut c) = t.conns.lock()
                    && let Some(s) = c.get_mut(&frame.conn)
                {
                    let _ = s.write_all(&ack); // a dead peer learns nothing; its writes flush
                }
            }
            let is_imm = frame.opcode == WR_RDMA_WRITE_WITH_IMM;
            if let Ok(mut sp) = t.spares.lock()
                && sp.len() < MAX_SPARES
            {
                sp.push(std::mem::take(&mut frame.payload));
            }
            if status == wc_status::SUCCESS && is_imm {
                let wc = Wc::new(
                    frame.wr_id,
                    status,
                    wc_opcode::RECV_RDMA_WITH_IMM,
                    len,
                    frame.imm,
                );
                abi::custody_kv_complete(ctx, &wc);
                out.push(wc);
            }
        }
        Ok(n)
    }

    fn connected(&self) -> bool {
        self.init.stream.is_some() && self.init.alive.load(Ordering::Acquire)
    }
}

/// Key and range checks, then the bytes land. Returns the `ibv_wc_status`.
fn land(t: &mut Target, mem: &mut dyn TargetMemory, f: &Frame) -> u32 {
    let len = match t.keys.get(&f.rkey) {
        Some(KeyEntry::Valid { len }) => *len,
        Some(KeyEntry::Invalidated) | None => {
            t.stats.rejected_writes += 1;
            return wc_status::REM_ACCESS_ERR;
        }
    };
    let base = region_base(f.rkey);
    let Some(offset) = f.remote_addr.checked_sub(base) else {
        t.stats.rejected_writes += 1;
        return wc_status::REM_ACCESS_ERR;
    };
    if offset
        .checked_add(f.payload.len() as u64)
        .is_none_or(|end| end > len)
    {
        t.stats.rejected_writes += 1;
        return wc_status::REM_ACCESS_ERR;
    }
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
    use super::super::abi::Sge;
    use super::*;

    #[derive(Default)]
    struct Mem {
        bytes: HashMap<u32, Vec<u8>>,
    }
    impl TargetMemory for Mem {
        fn write(
            &mut self,
            rkey: u32,
            offset: u64,
            b: &[u8],
        ) -> Result<(), super::super::AccessError> {
            let m = self.bytes.entry(rkey).or_insert_with(|| vec![0; 1024]);
            m[offset as usize..offset as usize + b.len()].copy_from_slice(b);
            Ok(())
        }
    }

    fn pair() -> (TcpTransport, TcpTransport) {
        let mut target = TcpTransport::new(2);
        let addr = target
            .listen("127.0.0.1:0".parse().expect("addr"))
            .expect("listen");
        let mut init = TcpTransport::new(1);
        init.connect(addr).expect("connect");
        (init, target)
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

    #[test]
    fn write_with_imm_lands_and_completes_then_invalidate_refuses() {
        let (mut init, mut target) = pair();
        let region = target.register(1024).expect("register");
        let data = [7u8; 100];
        let sge = [Sge {
            addr: data.as_ptr() as u64,
            length: 100,
            lkey: 0,
        }];
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

        target.invalidate(region.rkey).expect("invalidate");
        let data2 = [9u8; 100];
        let sge = [Sge {
            addr: data2.as_ptr() as u64,
            length: 100,
            lkey: 0,
        }];
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
    fn out_of_range_write_is_refused() {
        let (mut init, mut target) = pair();
        let region = target.register(64).expect("register");
        let data = [1u8; 100];
        let sge = [Sge {
            addr: data.as_ptr() as u64,
            length: 100,
            lkey: 0,
        }];
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
        let (mut init, mut target) = pair();
        let region = target.register(1024).expect("register");
        target.fault_inject_hold_key(region.rkey);
        let data = [3u8; 16];
        let sge = [Sge {
            addr: data.as_ptr() as u64,
            length: 16,
            lkey: 0,
        }];
        let wr = SendWr::rdma_write(1, &sge, region.base, region.rkey).with_imm(0);
        // SAFETY: `data` outlives the completion.
        unsafe { init.post_write(&wr) }.expect("post");
        let mut mem = Mem::default();
        let mut r = Vec::new();
        for _ in 0..2000 {
            target.poll_recv(&mut mem, &mut r, 64).expect("recv");
            if target.target.as_ref().is_some_and(|t| t.held.len() == 1) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        target.invalidate(region.rkey).expect("invalidate");
        assert_eq!(target.fault_inject_release_held(), 1);
        let (s, _) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR);
        assert!(mem.bytes.is_empty());
    }

    #[test]
    fn lost_connection_flushes_outstanding_writes_in_error() {
        let (mut init, mut target) = pair();
        let region = target.register(1024).expect("register");
        target.fault_inject_hold_key(region.rkey); // never acknowledged
        let data = [3u8; 16];
        let sge = [Sge {
            addr: data.as_ptr() as u64,
            length: 16,
            lkey: 0,
        }];
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
}
