//! `verbs`: the one-sided-write transport over real RDMA (libibverbs, through `rdma-sys`), behind
//! the `rdma` cargo feature.
//!
//! One [`VerbsTransport`] owns one device context, a protection domain, a send and a receive
//! completion queue and one reliable-connected (RC) queue pair. The connection is set up out of
//! band: each side sends its [`VerbsEndpoint`] (QPN, LID, GID, PSN, MTU) to the other over the
//! control plane, and each calls [`VerbsTransport::connect`] with the peer's endpoint, which
//! drives the QP `INIT → RTR → RTS`. A transport can be initiator, target, or both at once.
//!
//! # Semantics, compared with `tcp`
//! The trait's spec (`transport`'s module documentation) holds, with these differences that real
//! hardware imposes:
//! - **Landing.** The NIC writes into registered memory by itself; no CPU code runs per write.
//!   - [`VerbsTransport::register_memory`] registers caller memory (e.g. the KV pool): zero copy,
//!     the bytes are in place when the receive completion is reported, and [`TargetMemory`] is
//!     not used for such a region.
//!   - [`KvTransport::register`] (the trait) allocates an owned, page-aligned, zeroed staging
//!     buffer of `len` bytes and registers it. Whenever [`KvTransport::poll_recv`] reaps at least
//!     one receive completion, it copies each owned region that is still valid, **whole**, into
//!     `mem` (`TargetMemory::write(rkey, 0, bytes)`) before it reports the completions. So plain
//!     (non-immediate) writes become visible in `mem` with the next receive completion, and an
//!     invalidated region is never copied again. The copy costs the region's size per poll that
//!     reaped completions: this path is meant for tests and small regions; production targets
//!     use `register_memory`. A `TargetMemory::write` error is logged; it cannot be reported to
//!     the initiator, whose write already completed successfully.
//! - **Receive completions** carry the target's own receive-request id as `wr_id` (RDMA does not
//!   carry the initiator's `wr_id`): identify units by the immediate data. `poll_recv` returns
//!   the number of receive completions it reaped; only successful `RECV_RDMA_WITH_IMM` ones are
//!   appended to `out` (as in `tcp`).
//! - **Errors are fatal to the connection.** A failed write (`REM_ACCESS_ERR` after an
//!   invalidation, out-of-range, retries exhausted) moves the QP to the error state: every
//!   outstanding work request then completes with `WR_FLUSH_ERR` (unsignaled ones included),
//!   [`KvTransport::connected`] turns false, and `post_write` returns `Disconnected`. The
//!   responder's QP usually goes to error too (its receive requests flush). To reconnect, call
//!   [`VerbsTransport::reset`] on both sides and exchange endpoints again.
//! - **Invalidate** is `ibv_dereg_mr`: once it returns, the device cannot access the region
//!   through that key, so a later write with it fails with `REM_ACCESS_ERR`. Devices may recycle
//!   key values; this transport never hands out a key it invalidated before (it parks and retries
//!   such registrations), so a late write of an old key cannot match a new region — the same
//!   guarantee as `tcp`'s never-reused keys. Invalidating a key twice is not an error.
//! - **Local keys.** Gathered bytes must be in memory registered with this transport's
//!   protection domain: [`VerbsTransport::register_local`] (or a region of `register_memory`).
//!   An [`abi::Sge`] with `lkey == 0` is resolved to a registration covering its bytes (so callers
//!   written against `tcp`, which ignores `lkey`, work unchanged); the probe point sees the
//!   caller's structures as given.
//! - **Partial posts.** The chain is validated before anything is posted, but if
//!   `ibv_post_send` itself fails (send queue full) the requests before the failing one were
//!   posted; the error says how many.
//! - **Backpressure.** `rnr_retry = 7` (retry forever): a target that stops reposting receive
//!   requests (stops polling) stalls the initiator, as a full `tcp` queue does.
//!
//! # Who can write: what RC queue pairs and protection domains guarantee, and what they do not
//! - **Guaranteed by the device.** An RC queue pair accepts requests only from the one remote
//!   queue pair it was connected to (its QPN, within the expected PSN window); packets from any
//!   other QP are dropped by the HCA. A memory region's `rkey` works only for QPs of the same
//!   protection domain, and this transport's PD holds exactly one QP: a key is usable only over
//!   the paired connection — the verbs form of "bound to the connection that registered for
//!   it". The endpoints (QPN, PSN, GID) are exchanged only over the control plane, whose mutual
//!   TLS authenticates the peer node, and a re-handshake resets the QP (a fresh PSN).
//!   [`KvTransport::pair`] issues a [`Pairing`] for the same bookkeeping as `tcp` (one live pairing:
//!   `register` refuses any other id, `unpair` resets the QP), but its secret is not proved on
//!   the wire: verbs has no place for it.
//! - **Not guaranteed.** InfiniBand and RoCE packets carry no cryptographic authentication or
//!   encryption (the ICRC is a CRC). A host on the fabric that observes or guesses a live QPN,
//!   PSN, `rkey` and address can inject a write the HCA accepts (RoCE v2 is plain UDP/4791;
//!   device-chosen keys are often predictable — the ReDMArk study, USENIX Security 2021), and
//!   anyone on the path reads the KV bytes. P_Keys and VLANs partition a fabric; they are not
//!   secrets. Verbs therefore needs a fabric the operator controls (dedicated, or with the NIC's
//!   IPsec/MACsec offload); `transport_encryption` is refused for verbs rather than pretended.
//!   The page tags and the transfer checksum still reject pages that are stale, foreign or
//!   corrupt, but not a well-formed forgery from someone who knows the header's values.
//!
//! Every work request and completion is announced through the probe points of [`abi`]
//! (`custody_kv_post_write` before posting, `custody_kv_complete` per polled batch,
//! `custody_kv_register`, `custody_kv_invalidate`), exactly as `tcp` does.

use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::CStr;
use std::hash::BuildHasher;
use std::io;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};

use rdma_sys::{
    ___ibv_query_port, ibv_access_flags, ibv_alloc_pd, ibv_close_device, ibv_context, ibv_cq,
    ibv_create_cq, ibv_create_qp, ibv_dealloc_pd, ibv_dereg_mr, ibv_destroy_cq, ibv_destroy_qp,
    ibv_device, ibv_device_attr, ibv_free_device_list, ibv_get_device_list, ibv_get_device_name,
    ibv_gid, ibv_modify_qp, ibv_mr, ibv_mtu, ibv_open_device, ibv_pd, ibv_poll_cq, ibv_port_attr,
    ibv_port_state, ibv_post_recv, ibv_post_send, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask,
    ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_query_device, ibv_query_gid, ibv_recv_wr,
    ibv_reg_mr, ibv_send_wr, ibv_sge, ibv_wc, ibv_wc_flags, ibv_wr_opcode, rdma_t,
};

use super::abi::{self, SendWr, WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, Wc, wc_opcode, wc_status};
use super::{KeyInvalidated, KvTransport, Pairing, Region, TargetMemory, TransportError};

/// `IBV_LINK_LAYER_ETHERNET` (RoCE: addressing needs a GRH with the peer's GID).
const LINK_LAYER_ETHERNET: u8 = 2;
/// Alignment (and rounding) of owned staging buffers.
const PAGE: usize = 4096;
/// Completions fetched per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// Registrations parked at most while looking for a key that was never invalidated.
const MAX_PARKED: usize = 16;

/// The abi structures mirror libibverbs' (x86-64): posting and polling could even reuse them.
const _: () = {
    assert!(std::mem::size_of::<ibv_send_wr>() == std::mem::size_of::<SendWr>());
    assert!(std::mem::size_of::<ibv_sge>() == std::mem::size_of::<abi::Sge>());
    assert!(std::mem::size_of::<ibv_wc>() == std::mem::size_of::<Wc>());
    assert!(ibv_wr_opcode::IBV_WR_RDMA_WRITE == WR_RDMA_WRITE);
    assert!(ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM == WR_RDMA_WRITE_WITH_IMM);
};

/// How to open a [`VerbsTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsOptions {
    /// Device name (e.g. `mlx5_0`); `None` = the first device.
    pub device: Option<String>,
    /// Physical port (1-based).
    pub port: u8,
    /// GID table index. `None` = automatic: 0 on InfiniBand; on RoCE the first RoCE v2 GID with
    /// an IPv4-mapped address, else the first RoCE v2 GID, else the first non-empty one.
    pub gid_index: Option<u8>,
    /// Send queue depth (capped by the device).
    pub send_depth: u32,
    /// Receive requests kept posted for writes with immediate data (capped by the device).
    pub recv_depth: u32,
    /// Scatter/gather entries per work request (capped by the device).
    pub max_send_sge: u32,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: None,
            send_depth: 1024,
            recv_depth: 256,
            max_send_sge: 16,
        }
    }
}

/// What a peer needs to connect its QP to ours; carried by the control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct VerbsEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number (24 bits) of our send queue.
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (raw, network order).
    pub gid: [u8; 16],
    /// Active path MTU as `enum ibv_mtu` (1 = 256 … 5 = 4096).
    pub mtu: u32,
}

/// A local registration for gathered bytes (initiator side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRegion {
    pub lkey: u32,
    pub addr: u64,
    pub len: u64,
}

/// Owned, page-aligned, zeroed memory behind a region of [`KvTransport::register`].
#[derive(Debug)]
struct OwnedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl OwnedBuf {
    fn zeroed(len: usize) -> Result<Self, TransportError> {
        let size = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| TransportError::InvalidWr(format!("region of {len} B too large")))?;
        let layout = Layout::from_size_align(size, PAGE)
            .map_err(|e| TransportError::InvalidWr(format!("region of {len} B: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            TransportError::Io(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot allocate a {size} B region"),
            ))
        })?;
        Ok(Self { ptr, layout })
    }
}

impl Drop for OwnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout. Only dropped once the device can no
        // longer access it (its MR was deregistered, or never registered): see `Mr`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// One memory registration. Its owned buffer (if any) must outlive the registration: an entry
/// whose `ibv_dereg_mr` failed leaks the buffer instead of freeing it.
#[derive(Debug)]
struct Mr {
    mr: *mut ibv_mr,
    addr: u64,
    len: u64,
    lkey: u32,
    owned: Option<OwnedBuf>,
}

/// `ibv_get_device_list`'s result, freed on drop.
struct DeviceList {
    list: *mut *mut ibv_device,
    devices: Vec<(*mut ibv_device, String)>,
}

impl DeviceList {
    fn get() -> Result<Self, TransportError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the call has no other preconditions.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            let hint = if e.kind() == io::ErrorKind::Unsupported {
                "the kernel exposes no RDMA subsystem here (no /sys/class/infiniband_verbs: \
                 ib_uverbs not loaded, no RDMA NIC, or not mapped into this container)"
            } else {
                "libibverbs could not enumerate RDMA devices"
            };
            return Err(TransportError::NoDevice(format!(
                "ibv_get_device_list failed ({e}): {hint}"
            )));
        }
        let mut this = Self {
            list,
            devices: Vec::new(),
        };
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the list holds `n` device pointers (then a NULL terminator).
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: `dev` is a device of the live list; the name is a NUL-terminated string
            // owned by the device.
            let name = unsafe {
                let p = ibv_get_device_name(dev);
                if p.is_null() {
                    format!("<device {i}>")
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            this.devices.push((dev, name));
        }
        if this.devices.is_empty() {
            return Err(TransportError::NoDevice(
                "ibv_get_device_list found 0 RDMA devices (is an RDMA NIC present, its driver \
                 and provider library installed, and /dev/infiniband visible?)"
                    .into(),
            ));
        }
        Ok(this)
    }

    fn pick(&self, name: Option<&str>) -> Result<(*mut ibv_device, String), TransportError> {
        match name {
            None => Ok(self.devices[0].clone()),
            Some(want) => self
                .devices
                .iter()
                .find(|(_, n)| n == want)
                .cloned()
                .ok_or_else(|| {
                    let names: Vec<&str> = self.devices.iter().map(|(_, n)| n.as_str()).collect();
                    TransportError::NoDevice(format!(
                        "no RDMA device named {want:?} (found: {})",
                        names.join(", ")
                    ))
                }),
        }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once. Opened contexts stay
        // valid after the list is freed (ibv_get_device_list(3)).
        unsafe { ibv_free_device_list(self.list) };
    }
}

/// An I/O error from a verbs call: `rc > 0` is an errno value, otherwise errno holds it.
fn verbs_err(what: &str, rc: c_int) -> TransportError {
    let e = if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        io::Error::last_os_error()
    };
    TransportError::Io(io::Error::new(e.kind(), format!("{what}: {e}")))
}

fn fresh_psn(ctx: u64) -> u32 {
    (std::collections::hash_map::RandomState::new().hash_one(ctx) as u32) & 0x00ff_ffff
}

/// The RDMA transport. See the module documentation.
pub struct VerbsTransport {
    ctx: u64,
    device_name: String,
    port: u8,
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    qpn: u32,
    send_depth: u32,
    recv_depth: u32,
    max_send_sge: u32,
    link_layer: u8,
    lid: u16,
    active_mtu: u32,
    gid_index: u8,
    gid: [u8; 16],
    psn: u32,
    remote: Option<VerbsEndpoint>,
    /// The one live pairing (regions are registered for it); see the module docs.
    pairing: Option<u64>,
    /// The QP went to the error state (an error completion was seen).
    broken: bool,
    /// Receive requests are tagged `(generation << 32) | seq`; `reset` starts a generation.
    recv_gen: u32,
    recv_seq: u32,
    recv_posted: u32,
    /// Target regions by rkey.
    regions: HashMap<u32, Mr>,
    /// Initiator registrations by lkey.
    locals: HashMap<u32, Mr>,
    /// Every registration by `(addr, lkey)` → length, for resolving `lkey == 0`.
    by_addr: BTreeMap<(u64, u32), u64>,
    /// Keys invalidated during this transport's life; never handed out again.
    retired: HashSet<u32>,
    /// Send completions of the previous connection, drained by `reset` (so that its errors do
    /// not mark the new connection broken) and delivered by the next `poll_send`.
    stale_send: VecDeque<Wc>,
    scratch: Vec<u8>,
}

// SAFETY: the raw pointers are handles to libibverbs objects owned by this transport (no one
// else holds them) and to heap memory it owns. libibverbs is thread-safe and its objects are not
// tied to the thread that created them, so the transport may move between threads; `&mut self`
// serializes its use.
unsafe impl Send for VerbsTransport {}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("ctx", &format_args!("{:#x}", self.ctx))
            .field("device", &self.device_name)
            .field("port", &self.port)
            .field("qpn", &self.qpn)
            .field("gid_index", &self.gid_index)
            .field("remote", &self.remote)
            .field("broken", &self.broken)
            .field("regions", &self.regions.len())
            .field("locals", &self.locals.len())
            .finish_non_exhaustive()
    }
}

impl VerbsTransport {
    /// Open `device` (or the first one) on port 1 with default options.
    ///
    /// Returns [`TransportError::NoDevice`] when there is no usable RDMA device (no kernel
    /// support, no device, unknown name, device cannot be opened, port not active).
    pub fn open(node: u32, device: Option<&str>) -> Result<Self, TransportError> {
        Self::open_with(
            node,
            &VerbsOptions {
                device: device.map(str::to_owned),
                ..VerbsOptions::default()
            },
        )
    }

    /// Open with explicit options: context, protection domain, CQs and an RC QP in `INIT` with
    /// receive requests posted. Connect with [`VerbsTransport::connect`].
    pub fn open_with(node: u32, opts: &VerbsOptions) -> Result<Self, TransportError> {
        let ctx = abi::new_ctx(node);
        let list = DeviceList::get()?;
        let (dev, device_name) = list.pick(opts.device.as_deref())?;
        // Built step by step: on an early return, `Drop` releases what exists (null = absent).
        let mut t = Self {
            ctx,
            device_name,
            port: opts.port,
            context: ptr::null_mut(),
            pd: ptr::null_mut(),
            send_cq: ptr::null_mut(),
            recv_cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            qpn: 0,
            send_depth: 0,
            recv_depth: 0,
            max_send_sge: 0,
            link_layer: 0,
            lid: 0,
            active_mtu: 0,
            gid_index: 0,
            gid: [0; 16],
            psn: fresh_psn(ctx),
            remote: None,
            pairing: None,
            broken: false,
            recv_gen: 0,
            recv_seq: 0,
            recv_posted: 0,
            regions: HashMap::new(),
            locals: HashMap::new(),
            by_addr: BTreeMap::new(),
            retired: HashSet::new(),
            stale_send: VecDeque::new(),
            scratch: Vec::new(),
        };
        // SAFETY: `dev` belongs to the live device list.
        t.context = unsafe { ibv_open_device(dev) };
        if t.context.is_null() {
            let e = io::Error::last_os_error();
            return Err(TransportError::NoDevice(format!(
                "cannot open RDMA device {}: {e} (is /dev/infiniband/uverbs* accessible?)",
                t.device_name
            )));
        }
        drop(list);

        // SAFETY: ibv_device_attr is plain data (integers and arrays): all-zero is valid.
        let mut dattr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: open context and a valid out-pointer.
        let rc = unsafe { ibv_query_device(t.context, &mut dattr) };
        if rc != 0 {
            return Err(verbs_err("ibv_query_device", rc));
        }
        if opts.port == 0 || opts.port > dattr.phys_port_cnt {
            return Err(TransportError::NoDevice(format!(
                "{} has {} port(s); port {} requested",
                t.device_name, dattr.phys_port_cnt, opts.port
            )));
        }
        // SAFETY: ibv_port_attr is plain data: all-zero is valid (and what the compat path of
        // ibv_query_port expects).
        let mut pattr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: open context, existing port, valid out-pointer of the full structure's size.
        let rc = unsafe { ___ibv_query_port(t.context, opts.port, &mut pattr) };
        if rc != 0 {
            return Err(verbs_err("ibv_query_port", rc));
        }
        if pattr.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(TransportError::NoDevice(format!(
                "port {} of {} is not active (state {}; 4 = active)",
                opts.port, t.device_name, pattr.state
            )));
        }
        t.link_layer = pattr.link_layer;
        t.lid = pattr.lid;
        t.active_mtu = pattr.active_mtu;
        let (gid_index, gid) = t.select_gid(pattr.gid_tbl_len, opts.gid_index)?;
        t.gid_index = gid_index;
        t.gid = gid;

        let cap = |want: u32, dev_max: c_int| want.clamp(1, u32::try_from(dev_max).unwrap_or(1));
        t.send_depth = cap(opts.send_depth, dattr.max_qp_wr);
        t.recv_depth = cap(opts.recv_depth, dattr.max_qp_wr);
        t.max_send_sge = cap(opts.max_send_sge, dattr.max_sge);

        // SAFETY: open context.
        t.pd = unsafe { ibv_alloc_pd(t.context) };
        if t.pd.is_null() {
            return Err(verbs_err("ibv_alloc_pd", -1));
        }
        let max_cqe = dattr.max_cqe;
        // Twice the queue depth: after `reset`, completions of the previous connection may
        // still sit in a CQ next to those of the new one.
        let cqe = |depth: u32| {
            c_int::try_from(depth.saturating_mul(2))
                .unwrap_or(c_int::MAX)
                .min(max_cqe)
        };
        // SAFETY: open context; no completion channel, vector 0.
        t.send_cq = unsafe {
            ibv_create_cq(
                t.context,
                cqe(t.send_depth),
                ptr::null_mut(),
                ptr::null_mut(),
                0,
            )
        };
        if t.send_cq.is_null() {
            return Err(verbs_err("ibv_create_cq (send)", -1));
        }
        // SAFETY: as above.
        t.recv_cq = unsafe {
            ibv_create_cq(
                t.context,
                cqe(t.recv_depth),
                ptr::null_mut(),
                ptr::null_mut(),
                0,
            )
        };
        if t.recv_cq.is_null() {
            return Err(verbs_err("ibv_create_cq (recv)", -1));
        }
        // SAFETY: ibv_qp_init_attr is plain data (pointers and integers): all-zero is valid.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = t.send_cq;
        init.recv_cq = t.recv_cq;
        init.cap.max_send_wr = t.send_depth;
        init.cap.max_recv_wr = t.recv_depth;
        init.cap.max_send_sge = t.max_send_sge;
        init.cap.max_recv_sge = 1;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: live PD and CQs of the same context; valid attribute pointer.
        t.qp = unsafe { ibv_create_qp(t.pd, &mut init) };
        if t.qp.is_null() {
            return Err(verbs_err("ibv_create_qp", -1));
        }
        // SAFETY: `qp` was just created and is live.
        t.qpn = unsafe { (*t.qp).qp_num };
        // The device may grant more than asked; it never grants less (or creation fails).
        t.max_send_sge = t.max_send_sge.min(init.cap.max_send_sge.max(1));
        t.enter_init()?;
        tracing::info!(
            device = %t.device_name,
            port = t.port,
            qpn = t.qpn,
            gid_index = t.gid_index,
            "RDMA KV transport opened"
        );
        Ok(t)
    }

    /// The probe context of this instance.
    pub fn ctx(&self) -> u64 {
        self.ctx
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The GID table index in use.
    pub fn gid_index(&self) -> u8 {
        self.gid_index
    }

    /// What the peer needs to connect to this transport (send it over the control plane).
    pub fn local_endpoint(&self) -> VerbsEndpoint {
        VerbsEndpoint {
            qpn: self.qpn,
            psn: self.psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.active_mtu,
        }
    }

    /// Connect the QP to the peer's endpoint (`INIT → RTR → RTS`). Both sides call it with the
    /// other's endpoint.
    pub fn connect(&mut self, remote: &VerbsEndpoint) -> Result<(), TransportError> {
        if self.remote.is_some() {
            return Err(TransportError::InvalidWr(
                "already connected (call reset() first)".into(),
            ));
        }
        if !(ibv_mtu::IBV_MTU_256..=ibv_mtu::IBV_MTU_4096).contains(&remote.mtu) {
            return Err(TransportError::InvalidWr(format!(
                "peer endpoint has an invalid MTU code {}",
                remote.mtu
            )));
        }
        // SAFETY: ibv_qp_attr is plain data (integers, and a union of byte arrays/integers):
        // all-zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.active_mtu.min(remote.mtu);
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn & 0x00ff_ffff;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12; // 0.64 ms
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.port;
        if self.link_layer == LINK_LAYER_ETHERNET {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = self.gid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify_qp(&mut a, mask, "INIT→RTR")?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14; // 4.096 µs · 2^14 ≈ 67 ms per transport retry
        a.retry_cnt = 7;
        a.rnr_retry = 7; // forever: backpressure, see the module documentation
        a.sq_psn = self.psn;
        a.max_rd_atomic = 1;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify_qp(&mut a, mask, "RTR→RTS")?;
        self.remote = Some(*remote);
        self.broken = false;
        Ok(())
    }

    /// Take the QP back to `INIT` (after an error, or to reconnect): outstanding requests are
    /// discarded, receive requests reposted, and a new PSN chosen — exchange endpoints again.
    /// Registrations are kept; send completions still queued are delivered by the next
    /// `poll_send`.
    pub fn reset(&mut self) -> Result<(), TransportError> {
        // SAFETY: as in `connect`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RESET;
        self.modify_qp(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "→RESET")?;
        // In RESET the QP produces no more completions: keep what the old connection left.
        let stale = &mut self.stale_send;
        poll_cq(self.send_cq, usize::MAX, |raw| {
            stale.push_back(wc_from_ibv(raw, wc_opcode::RDMA_WRITE));
        })?;
        self.remote = None;
        self.broken = false;
        self.psn = fresh_psn(self.ctx ^ u64::from(self.psn));
        self.enter_init()
    }

    /// Target, zero copy: register `len` bytes at `addr` for remote writes
    /// (`IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE`). The region's `base` is `addr`.
    /// Writes land there directly; [`TargetMemory`] is not used for it.
    ///
    /// # Safety
    /// `addr..addr + len` must be memory the caller owns, valid for writes, and may be written
    /// by the device at any time (without the CPU's involvement) until [`KvTransport::invalidate`]
    /// of the returned key returns or the transport is dropped; it must stay allocated that long.
    pub unsafe fn register_memory(
        &mut self,
        addr: *mut u8,
        len: usize,
    ) -> Result<Region, TransportError> {
        // SAFETY: the caller's contract is the one `register_target` needs.
        unsafe { self.register_target(addr, len, None) }
    }

    /// Initiator: register `len` bytes at `addr` as a source of gathered bytes (local read
    /// only). Use the returned `lkey` in [`abi::Sge::lkey`], or leave `lkey` 0 to have it
    /// resolved.
    ///
    /// # Safety
    /// `addr..addr + len` must be mapped, readable memory that stays allocated until
    /// [`VerbsTransport::deregister_local`] or the transport is dropped.
    pub unsafe fn register_local(
        &mut self,
        addr: *const u8,
        len: usize,
    ) -> Result<LocalRegion, TransportError> {
        // SAFETY: live PD; the caller guarantees the range (access 0: the device only reads).
        let mr = unsafe { ibv_reg_mr(self.pd, addr.cast_mut().cast(), len, 0) };
        if mr.is_null() {
            return Err(verbs_err("ibv_reg_mr (local)", -1));
        }
        // SAFETY: `mr` was just returned by ibv_reg_mr and is live.
        let lkey = unsafe { (*mr).lkey };
        let (addr, len) = (addr as u64, len as u64);
        self.locals.insert(
            lkey,
            Mr {
                mr,
                addr,
                len,
                lkey,
                owned: None,
            },
        );
        self.by_addr.insert((addr, lkey), len);
        Ok(LocalRegion { lkey, addr, len })
    }

    /// Initiator: drop a registration of [`VerbsTransport::register_local`]. Posted requests that
    /// still gather from it fail (`LOC_PROT_ERR`).
    pub fn deregister_local(&mut self, lkey: u32) -> Result<(), TransportError> {
        let Some(m) = self.locals.get(&lkey) else {
            return Err(TransportError::UnknownKey(lkey));
        };
        // SAFETY: a live MR of this transport, deregistered once (removed right after).
        let rc = unsafe { ibv_dereg_mr(m.mr) };
        if rc != 0 {
            return Err(verbs_err("ibv_dereg_mr (local)", rc));
        }
        if let Some(m) = self.locals.remove(&lkey) {
            self.by_addr.remove(&(m.addr, m.lkey));
        }
        Ok(())
    }

    /// # Safety
    /// As [`VerbsTransport::register_memory`]; an `owned` buffer must be the memory at `addr`.
    unsafe fn register_target(
        &mut self,
        addr: *mut u8,
        len: usize,
        owned: Option<OwnedBuf>,
    ) -> Result<Region, TransportError> {
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0 as c_int;
        let mut parked: Vec<*mut ibv_mr> = Vec::new();
        let result = loop {
            // SAFETY: live PD; the caller guarantees the range stays valid while registered.
            let mr = unsafe { ibv_reg_mr(self.pd, addr.cast(), len, access) };
            if mr.is_null() {
                break Err(verbs_err("ibv_reg_mr", -1));
            }
            // SAFETY: `mr` was just returned by ibv_reg_mr and is live.
            let rkey = unsafe { (*mr).rkey };
            if !self.retired.contains(&rkey) {
                break Ok(mr);
            }
            // The device recycled an invalidated key: keep this registration until we hold one
            // with a fresh key, so that the device cannot hand the same key out again.
            parked.push(mr);
            if parked.len() >= MAX_PARKED {
                break Err(TransportError::InvalidWr(format!(
                    "{} keeps handing out invalidated keys",
                    self.device_name
                )));
            }
        };
        for p in parked {
            // SAFETY: registrations made above and never exposed; deregistered once.
            let rc = unsafe { ibv_dereg_mr(p) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_dereg_mr of a parked registration failed");
            }
        }
        let mr = result?;
        // SAFETY: live MR.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        let (base, len) = (addr as u64, len as u64);
        self.regions.insert(
            rkey,
            Mr {
                mr,
                addr: base,
                len,
                lkey,
                owned,
            },
        );
        self.by_addr.insert((base, lkey), len);
        abi::custody_kv_register(self.ctx, rkey, base, len);
        Ok(Region { rkey, base, len })
    }

    fn modify_qp(
        &mut self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        what: &str,
    ) -> Result<(), TransportError> {
        let mask = c_int::try_from(mask.0).unwrap_or(c_int::MAX);
        // SAFETY: live QP; `attr` is a valid attribute structure for the fields in `mask`.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask) };
        if rc != 0 {
            return Err(verbs_err(&format!("ibv_modify_qp {what}"), rc));
        }
        Ok(())
    }

    /// `RESET → INIT` (port, access), then post the receive requests.
    fn enter_init(&mut self) -> Result<(), TransportError> {
        // SAFETY: as in `connect`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = self.port;
        a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify_qp(&mut a, mask, "RESET→INIT")?;
        self.recv_gen = self.recv_gen.wrapping_add(1);
        self.recv_seq = 0;
        self.recv_posted = 0;
        self.refill_recv()
    }

    /// Keep `recv_depth` zero-length receive requests posted (a write with immediate data
    /// consumes one).
    fn refill_recv(&mut self) -> Result<(), TransportError> {
        if self.broken || self.recv_posted >= self.recv_depth {
            return Ok(());
        }
        let want = (self.recv_depth - self.recv_posted) as usize;
        let mut wrs: Vec<ibv_recv_wr> = Vec::with_capacity(want);
        for _ in 0..want {
            let wr_id = (u64::from(self.recv_gen) << 32) | u64::from(self.recv_seq);
            self.recv_seq = self.recv_seq.wrapping_add(1);
            wrs.push(ibv_recv_wr {
                wr_id,
                next: ptr::null_mut(),
                sg_list: ptr::null_mut(),
                num_sge: 0,
            });
        }
        let base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate().take(want - 1) {
            // SAFETY: `i + 1 < want == wrs.len()`; the vector is not resized afterwards.
            wr.next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; the chain is valid for the call (the provider copies it).
        let rc = unsafe { ibv_post_recv(self.qp, base, &mut bad) };
        if rc != 0 {
            let posted = if bad.is_null() {
                0
            } else {
                // SAFETY: `bad` points into `wrs` (the provider returns the failing request).
                unsafe { bad.offset_from(base) }.max(0) as usize
            };
            self.recv_posted += posted as u32;
            return Err(verbs_err(
                &format!("ibv_post_recv ({posted} of {want} posted)"),
                rc,
            ));
        }
        self.recv_posted += want as u32;
        Ok(())
    }

    fn select_gid(
        &self,
        gid_tbl_len: c_int,
        requested: Option<u8>,
    ) -> Result<(u8, [u8; 16]), TransportError> {
        let query = |index: u8| -> Result<[u8; 16], TransportError> {
            let mut gid = ibv_gid { raw: [0; 16] };
            // SAFETY: open context, existing port, valid out-pointer.
            let rc =
                unsafe { ibv_query_gid(self.context, self.port, c_int::from(index), &mut gid) };
            if rc != 0 {
                return Err(verbs_err(&format!("ibv_query_gid index {index}"), rc));
            }
            // SAFETY: every bit pattern is a valid `[u8; 16]`.
            Ok(unsafe { gid.raw })
        };
        if let Some(index) = requested {
            let gid = query(index)?;
            if self.link_layer == LINK_LAYER_ETHERNET && gid == [0; 16] {
                return Err(TransportError::NoDevice(format!(
                    "GID index {index} of {} port {} is empty",
                    self.device_name, self.port
                )));
            }
            return Ok((index, gid));
        }
        if self.link_layer != LINK_LAYER_ETHERNET {
            return Ok((0, query(0)?));
        }
        // RoCE: prefer RoCE v2 (routable), with an IPv4-mapped address.
        let mut best: Option<(u8, u8, [u8; 16])> = None;
        let n = u8::try_from(gid_tbl_len.clamp(0, 255)).unwrap_or(0);
        for index in 0..n {
            let Ok(gid) = query(index) else { continue };
            if gid == [0; 16] {
                continue;
            }
            let kind = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{}/ports/{}/gid_attrs/types/{index}",
                self.device_name, self.port
            ))
            .unwrap_or_default();
            let v2 = kind.trim().eq_ignore_ascii_case("RoCE v2");
            let v4 = gid[..10] == [0; 10] && gid[10..12] == [0xff, 0xff];
            let score = 1 + u8::from(v2) + u8::from(v2 && v4);
            if best.is_none_or(|(s, _, _)| score > s) {
                best = Some((score, index, gid));
            }
        }
        best.map(|(_, i, g)| (i, g)).ok_or_else(|| {
            TransportError::NoDevice(format!(
                "no usable GID on {} port {} (RoCE needs an IP address on the interface)",
                self.device_name, self.port
            ))
        })
    }

    /// Copy every owned (staged) region into `mem`, whole.
    fn land_owned(&mut self, mem: &mut dyn TargetMemory) {
        let scratch = &mut self.scratch;
        for (&rkey, m) in &self.regions {
            let Some(buf) = &m.owned else { continue };
            let len = m.len as usize;
            scratch.clear();
            scratch.reserve(len);
            // SAFETY: `buf` holds at least `len` bytes (registered length) and stays allocated
            // while registered. The device may be writing bytes of requests not yet completed:
            // they are copied through raw pointers (no reference to the buffer is formed), and
            // whatever is copied of them is copied again at their own completion.
            unsafe {
                ptr::copy_nonoverlapping(buf.ptr.as_ptr(), scratch.as_mut_ptr(), len);
                scratch.set_len(len);
            }
            if let Err(e) = mem.write(rkey, 0, scratch) {
                tracing::warn!(rkey, error = %e, "KV region refused by target memory");
            }
        }
    }
}

/// A translated chain: `ibv_send_wr`s linked through `next`, pointing into `sges`. Both vectors
/// are complete before any pointer into them is taken and never resized afterwards (moving the
/// struct does not move their heap storage).
struct PostBatch {
    wrs: Vec<ibv_send_wr>,
    /// Kept alive: `wrs` points into it.
    _sges: Vec<ibv_sge>,
}

/// The registration covering `addr..addr + len`, if any.
fn lookup_lkey(by_addr: &BTreeMap<(u64, u32), u64>, addr: u64, len: u64) -> Option<u32> {
    let end = addr.checked_add(len)?;
    by_addr
        .range(..=(addr, u32::MAX))
        .rev()
        .find(|&(&(a, _), &l)| a.saturating_add(l) >= end)
        .map(|(&(_, k), _)| k)
}

/// Validate the abi chain and build the equivalent `ibv_send_wr` chain.
///
/// # Safety
/// As [`KvTransport::post_write`]: every `next` and `sg_list` pointer valid for the call.
unsafe fn translate_chain(
    first: &SendWr,
    max_chain: usize,
    max_sge: usize,
    lkey_for: impl Fn(u64, u64) -> Option<u32>,
) -> Result<PostBatch, TransportError> {
    // Pass 1: validate everything before anything is built or posted.
    // SAFETY: the caller guarantees the chain's pointers are valid.
    let chain = unsafe { crate::validated_chain(first, max_chain, max_sge) }?;
    let total_sges: usize = chain.iter().map(|w| w.num_sge as usize).sum();
    // Pass 2: the SGEs (resolving lkey 0), then the work requests pointing into them.
    let mut sges: Vec<ibv_sge> = Vec::with_capacity(total_sges);
    for w in &chain {
        // SAFETY: `w` is of the validated chain.
        for s in unsafe { crate::sges_of(w) } {
            let lkey = if s.lkey != 0 || s.length == 0 {
                s.lkey
            } else {
                lkey_for(s.addr, u64::from(s.length)).ok_or_else(|| {
                    TransportError::InvalidWr(format!(
                        "no local registration covers {:#x}+{} (register_local it or pass its lkey)",
                        s.addr, s.length
                    ))
                })?
            };
            sges.push(ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey,
            });
        }
    }
    let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(chain.len());
    let sge_base = sges.as_mut_ptr();
    let mut at = 0usize;
    for w in &chain {
        // SAFETY: ibv_send_wr is plain data (integers, pointers, unions of those): all-zero is
        // valid (null `next`, no SGEs, no flags).
        let mut x: ibv_send_wr = unsafe { std::mem::zeroed() };
        x.wr_id = w.wr_id;
        x.num_sge = w.num_sge;
        x.sg_list = if w.num_sge == 0 {
            ptr::null_mut()
        } else {
            // SAFETY: `at + num_sge <= sges.len()`: the SGEs were pushed in chain order.
            unsafe { sge_base.add(at) }
        };
        at += w.num_sge as usize;
        x.opcode = w.opcode;
        x.send_flags = w.send_flags;
        x.imm_data_invalidated_rkey_union.imm_data = w.imm_data; // already network order
        x.wr.rdma = rdma_t {
            remote_addr: w.remote_addr,
            rkey: w.rkey,
        };
        wrs.push(x);
    }
    let base = wrs.as_mut_ptr();
    let n = wrs.len();
    for (i, wr) in wrs.iter_mut().enumerate().take(n.saturating_sub(1)) {
        // SAFETY: `i + 1 < wrs.len()`; the vector is not resized afterwards.
        wr.next = unsafe { base.add(i + 1) };
    }
    Ok(PostBatch { wrs, _sges: sges })
}

/// The abi view of a completion. On error only `wr_id`, `status`, `vendor_err` and `qp_num` are
/// defined by verbs; the opcode is then `opcode_on_error`.
fn wc_from_ibv(wc: &ibv_wc, opcode_on_error: u32) -> Wc {
    if wc.status != wc_status::SUCCESS {
        let mut out = Wc::new(wc.wr_id, wc.status, opcode_on_error, 0, 0);
        out.wc_flags = 0;
        out.vendor_err = wc.vendor_err;
        out.qp_num = wc.qp_num;
        return out;
    }
    let with_imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    let imm_host = if with_imm {
        // SAFETY: both union members are `u32`; with IBV_WC_WITH_IMM it holds the immediate.
        u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })
    } else {
        0
    };
    let mut out = Wc::new(wc.wr_id, wc.status, wc.opcode, wc.byte_len, imm_host);
    out.vendor_err = wc.vendor_err;
    out.qp_num = wc.qp_num;
    out.src_qp = wc.src_qp;
    out.wc_flags = wc.wc_flags;
    out.pkey_index = wc.pkey_index;
    out.slid = wc.slid;
    out.sl = wc.sl;
    out.dlid_path_bits = wc.dlid_path_bits;
    out
}

/// Poll up to `max` completions of `cq`, handing each to `f`.
fn poll_cq(
    cq: *mut ibv_cq,
    max: usize,
    mut f: impl FnMut(&ibv_wc),
) -> Result<usize, TransportError> {
    // SAFETY: ibv_wc is plain data: all-zero is valid.
    let mut buf: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
    let mut total = 0;
    while total < max {
        let want = (max - total).min(POLL_BATCH);
        // SAFETY: live CQ; `buf` has room for `want` completions.
        let n = unsafe { ibv_poll_cq(cq, want as c_int, buf.as_mut_ptr()) };
        if n < 0 {
            return Err(verbs_err("ibv_poll_cq", n));
        }
        let n = n as usize;
        for wc in &buf[..n] {
            f(wc);
        }
        total += n;
        if n < want {
            break;
        }
    }
    Ok(total)
}

impl KvTransport for VerbsTransport {
    /// An owned, page-aligned, zeroed staging region; see the module documentation for how its
    /// bytes reach [`TargetMemory`]. `len` must be non-zero for most devices.
    fn pair(&mut self) -> Result<Pairing, TransportError> {
        let p = Pairing::generate()?;
        self.pairing = Some(p.id());
        Ok(p)
    }

    fn unpair(&mut self, pairing_id: u64) {
        if self.pairing == Some(pairing_id) {
            self.pairing = None;
            if let Err(e) = VerbsTransport::reset(self) {
                tracing::warn!(error = %e, "unpair: resetting the queue pair failed");
            }
        }
    }

    fn register(&mut self, len: u64, pairing_id: u64) -> Result<Region, TransportError> {
        if self.pairing != Some(pairing_id) {
            return Err(TransportError::Auth(format!(
                "no live pairing {pairing_id:#018x} to register a region for"
            )));
        }
        let n = usize::try_from(len)
            .map_err(|_| TransportError::InvalidWr(format!("region of {len} B too large")))?;
        let buf = OwnedBuf::zeroed(n)?;
        let addr = buf.ptr.as_ptr();
        // SAFETY: `buf` owns at least `n` writable bytes at `addr` and moves into the MR entry,
        // which frees it only after a successful deregistration (or leaks it).
        unsafe { self.register_target(addr, n, Some(buf)) }
    }

    fn invalidate(&mut self, rkey: u32) -> Result<KeyInvalidated, TransportError> {
        if self.retired.contains(&rkey) {
            abi::custody_kv_invalidate(self.ctx, rkey);
            return Ok(KeyInvalidated::issued_by_transport(rkey));
        }
        let Some(m) = self.regions.get(&rkey) else {
            return Err(TransportError::UnknownKey(rkey));
        };
        // SAFETY: a live MR of this transport, deregistered once (removed right after). After
        // it returns, the device can no longer access the memory through this key.
        let rc = unsafe { ibv_dereg_mr(m.mr) };
        if rc != 0 {
            return Err(verbs_err("ibv_dereg_mr", rc));
        }
        if let Some(m) = self.regions.remove(&rkey) {
            self.by_addr.remove(&(m.addr, m.lkey));
            drop(m); // frees an owned buffer: no longer reachable by the device
        }
        self.retired.insert(rkey);
        abi::custody_kv_invalidate(self.ctx, rkey);
        // Deregistered: the device can no longer write through this key.
        Ok(KeyInvalidated::issued_by_transport(rkey))
    }

    unsafe fn post_write(&mut self, wr: &SendWr) -> Result<(), TransportError> {
        abi::custody_kv_post_write(self.ctx, wr);
        if self.remote.is_none() {
            return Err(TransportError::NotConnected);
        }
        if self.broken {
            return Err(TransportError::Disconnected);
        }
        let by_addr = &self.by_addr;
        // SAFETY: forwarded from the caller of `post_write`.
        let mut batch = unsafe {
            translate_chain(
                wr,
                self.send_depth as usize,
                self.max_send_sge as usize,
                |addr, len| lookup_lkey(by_addr, addr, len),
            )
        }?;
        let n = batch.wrs.len();
        let base = batch.wrs.as_mut_ptr();
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the chain and its SGEs are valid for the call (the provider copies
        // them into the send queue); the gathered bytes stay valid until completion (the
        // caller's contract of `post_write`).
        let rc = unsafe { ibv_post_send(self.qp, base, &mut bad) };
        if rc != 0 {
            let posted = if bad.is_null() {
                0
            } else {
                // SAFETY: `bad` points into `batch.wrs` (the provider returns the failing one).
                unsafe { bad.offset_from(base) }.max(0) as usize
            };
            return Err(verbs_err(
                &format!("ibv_post_send (the first {posted} of {n} requests were posted)"),
                rc,
            ));
        }
        Ok(())
    }

    fn poll_send(&mut self, out: &mut Vec<Wc>, max: usize) -> Result<usize, TransportError> {
        if self.remote.is_none() && !self.broken && self.stale_send.is_empty() {
            return Err(TransportError::NotConnected);
        }
        let ctx = self.ctx;
        let announced = out.len();
        let mut stale = 0;
        while stale < max
            && let Some(wc) = self.stale_send.pop_front()
        {
            out.push(wc);
            stale += 1;
        }
        let mut first_err: Option<Wc> = None;
        let n = poll_cq(self.send_cq, max - stale, |raw| {
            let wc = wc_from_ibv(raw, wc_opcode::RDMA_WRITE);
            if !wc.ok() && first_err.is_none() {
                first_err = Some(wc);
            }
            out.push(wc);
        })?;
        // One probe hit per poll: what `ibv_poll_cq` returned (and any parked stale entries).
        abi::announce_completions(ctx, &out[announced..]);
        if let Some(wc) = first_err
            && !self.broken
        {
            self.broken = true;
            tracing::warn!(
                wr_id = wc.wr_id,
                status = wc.status,
                vendor_err = wc.vendor_err,
                "RDMA write failed; the queue pair is in error (reset and reconnect)"
            );
        }
        Ok(stale + n)
    }

    fn poll_recv(
        &mut self,
        mem: &mut dyn TargetMemory,
        out: &mut Vec<Wc>,
        max: usize,
    ) -> Result<usize, TransportError> {
        let gen_now = self.recv_gen;
        let mut landed: Vec<Wc> = Vec::new();
        let mut consumed = 0u32;
        let mut first_err: Option<Wc> = None;
        let n = poll_cq(self.recv_cq, max, |raw| {
            let current = (raw.wr_id >> 32) as u32 == gen_now;
            consumed += u32::from(current);
            let wc = wc_from_ibv(raw, wc_opcode::RECV_RDMA_WITH_IMM);
            if wc.ok() && wc.opcode == wc_opcode::RECV_RDMA_WITH_IMM {
                landed.push(wc);
            } else if !wc.ok() {
                if current && first_err.is_none() {
                    first_err = Some(wc);
                }
            } else {
                tracing::warn!(opcode = wc.opcode, "unexpected receive completion ignored");
            }
        })?;
        self.recv_posted = self.recv_posted.saturating_sub(consumed);
        if let Some(wc) = first_err
            && !self.broken
        {
            self.broken = true;
            tracing::warn!(
                status = wc.status,
                vendor_err = wc.vendor_err,
                "RDMA receive queue flushed; the queue pair is in error (reset and reconnect)"
            );
        }
        if !landed.is_empty() {
            self.land_owned(mem);
        }
        abi::announce_completions(self.ctx, &landed);
        out.extend_from_slice(&landed);
        self.refill_recv()?;
        Ok(n)
    }

    fn connected(&self) -> bool {
        self.remote.is_some() && !self.broken
    }

    fn kind(&self) -> &'static str {
        "verbs"
    }

    /// The queue pair's [`VerbsEndpoint`] as JSON.
    fn endpoint(&self) -> String {
        serde_json::to_string(&self.local_endpoint()).unwrap_or_default()
    }

    /// Parse the peer's JSON endpoint; reset first if this QP was connected (or broken).
    fn connect_peer(&mut self, peer: &str, _pairing: &Pairing) -> Result<(), TransportError> {
        let remote: VerbsEndpoint = serde_json::from_str(peer)
            .map_err(|e| TransportError::BadEndpoint(format!("{peer}: {e}")))?;
        if self.remote.is_some() || self.broken {
            VerbsTransport::reset(self)?;
        }
        self.connect(&remote)
    }

    fn reset(&mut self) -> Result<(), TransportError> {
        VerbsTransport::reset(self)
    }

    unsafe fn register_source(
        &mut self,
        addr: *const u8,
        len: usize,
    ) -> Result<u32, TransportError> {
        // SAFETY: forwarded from the caller (same contract as `register_local`).
        unsafe { self.register_local(addr, len) }.map(|r| r.lkey)
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        // Order: QP, CQs, MRs, PD, context (the device list was freed after opening).
        if !self.qp.is_null() {
            // SAFETY: live QP, destroyed once.
            let rc = unsafe { ibv_destroy_qp(self.qp) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_destroy_qp failed");
            }
        }
        for cq in [self.send_cq, self.recv_cq] {
            if !cq.is_null() {
                // SAFETY: live CQ, no longer used by a QP, destroyed once.
                let rc = unsafe { ibv_destroy_cq(cq) };
                if rc != 0 {
                    tracing::warn!(rc, "ibv_destroy_cq failed");
                }
            }
        }
        for (_, mut m) in self.regions.drain().chain(self.locals.drain()) {
            // SAFETY: live MR of this transport, deregistered once.
            let rc = unsafe { ibv_dereg_mr(m.mr) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_dereg_mr failed; leaking the region's memory");
                std::mem::forget(m.owned.take());
            }
        }
        if !self.pd.is_null() {
            // SAFETY: live PD with no remaining QP or MR, deallocated once.
            let rc = unsafe { ibv_dealloc_pd(self.pd) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_dealloc_pd failed");
            }
        }
        if !self.context.is_null() {
            // SAFETY: open context with nothing left allocated from it, closed once.
            let rc = unsafe { ibv_close_device(self.context) };
            if rc != 0 {
                tracing::warn!(rc, "ibv_close_device failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AccessError;
    use crate::abi::Sge;

    #[derive(Default)]
    struct Mem {
        bytes: HashMap<u32, Vec<u8>>,
    }
    impl TargetMemory for Mem {
        fn write(&mut self, rkey: u32, offset: u64, b: &[u8]) -> Result<(), AccessError> {
            let m = self.bytes.entry(rkey).or_default();
            let end = offset as usize + b.len();
            if m.len() < end {
                m.resize(end, 0);
            }
            m[offset as usize..end].copy_from_slice(b);
            Ok(())
        }
    }

    #[test]
    fn open_without_a_device_reports_no_device() {
        match VerbsTransport::open(1, None) {
            Err(TransportError::NoDevice(msg)) => {
                assert!(!msg.is_empty());
                eprintln!("no RDMA device here (expected on this machine): {msg}");
                // A named device is refused the same way.
                let named = VerbsTransport::open(1, Some("no-such-device-0"));
                assert!(
                    matches!(named, Err(TransportError::NoDevice(_))),
                    "{named:?}"
                );
            }
            Ok(t) => eprintln!(
                "RDMA device present ({}); see the loopback test",
                t.device_name()
            ),
            Err(e) => panic!("open failed with something other than NoDevice: {e}"),
        }
    }

    fn pump(
        init: &mut VerbsTransport,
        target: &mut VerbsTransport,
        mem: &mut Mem,
        want_send: usize,
    ) -> (Vec<Wc>, Vec<Wc>) {
        let (mut s, mut r) = (Vec::new(), Vec::new());
        for _ in 0..5000 {
            target.poll_recv(mem, &mut r, 64).expect("recv");
            init.poll_send(&mut s, 64).expect("send");
            if s.len() >= want_send {
                // Let the receive side catch up with what completed on the send side.
                for _ in 0..50 {
                    target.poll_recv(mem, &mut r, 64).expect("recv");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        (s, r)
    }

    /// Needs an RDMA device (any, incl. soft-RoCE `rxe`); skipped loudly without one.
    #[test]
    fn loopback_write_with_imm_lands_then_invalidate_refuses() {
        // Declared before the transports, so dropped after them (also when a check panics).
        let mut zc = vec![0u8; 4096];
        let data = [7u8; 100];
        let data2 = [9u8; 100];
        let mut init = match VerbsTransport::open(1, None) {
            Ok(t) => t,
            Err(TransportError::NoDevice(msg)) => {
                custody_test_skip::skip(
                    "custody_transport::verbs::loopback_write_with_imm_lands_then_invalidate_refuses",
                    &format!("no RDMA device: {msg}"),
                    custody_test_skip::Need::Optional,
                );
                return;
            }
            Err(e) => panic!("open: {e}"),
        };
        let mut target = VerbsTransport::open(2, Some(init.device_name())).expect("open target");
        // Staged region (trait `register`) and a zero-copy one (`register_memory`).
        let pairing = target.pair().expect("pair");
        let region = target.register(1024, pairing.id()).expect("register");
        // SAFETY: `zc` outlives `target` (declared first, dropped last).
        let zc_region =
            unsafe { target.register_memory(zc.as_mut_ptr(), zc.len()) }.expect("register_memory");
        let (ei, et) = (init.local_endpoint(), target.local_endpoint());
        let json = serde_json::to_string(&et).expect("serialize");
        let et: VerbsEndpoint = serde_json::from_str(&json).expect("deserialize");
        init.connect(&et).expect("connect initiator");
        target.connect(&ei).expect("connect target");
        assert!(init.connected() && target.connected());

        // SAFETY: `data` outlives `init` (declared first, dropped last).
        let local = unsafe { init.register_local(data.as_ptr(), data.len()) }.expect("local");
        let sge = [Sge {
            addr: data.as_ptr() as u64,
            length: 100,
            lkey: local.lkey,
        }];
        let sge0 = [Sge {
            addr: data.as_ptr() as u64 + 50,
            length: 50,
            lkey: 0, // resolved
        }];
        let mut w1 = SendWr::rdma_write(41, &sge0, zc_region.base + 8, zc_region.rkey);
        let w2 = SendWr::rdma_write(42, &sge, region.base + 10, region.rkey).with_imm(5);
        w1.next = &w2;
        // SAFETY: `data` stays valid until the completion is polled below.
        unsafe { init.post_write(&w1) }.expect("post");
        let mut mem = Mem::default();
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s.len(), 1, "{s:?}");
        assert!(s[0].ok() && s[0].wr_id == 42, "{:?}", s[0]);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0].imm(), 5);
        assert_eq!(r[0].opcode, wc_opcode::RECV_RDMA_WITH_IMM);
        assert_eq!(&mem.bytes[&region.rkey][10..110], &data[..]);
        assert_eq!(&zc[8..58], &data[50..], "zero-copy region written in place");
        assert!(!mem.bytes.contains_key(&zc_region.rkey));

        let _proof = target.invalidate(region.rkey).expect("invalidate");
        // SAFETY: as above.
        let local2 = unsafe { init.register_local(data2.as_ptr(), data2.len()) }.expect("local");
        let sge = [Sge {
            addr: data2.as_ptr() as u64,
            length: 100,
            lkey: local2.lkey,
        }];
        let wr = SendWr::rdma_write(43, &sge, region.base + 10, region.rkey).with_imm(6);
        // SAFETY: as above.
        unsafe { init.post_write(&wr) }.expect("post");
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert_eq!(s[0].status, wc_status::REM_ACCESS_ERR, "{:?}", s[0]);
        assert!(r.is_empty(), "{r:?}");
        assert_eq!(
            &mem.bytes[&region.rkey][10..110],
            &data[..],
            "nothing landed"
        );
        assert!(!init.connected());
        let again = SendWr::rdma_write(44, &sge, zc_region.base, zc_region.rkey).with_imm(7);
        // SAFETY: as above.
        let e = unsafe { init.post_write(&again) };
        assert!(matches!(e, Err(TransportError::Disconnected)), "{e:?}");

        // Reconnect after the error.
        init.reset().expect("reset");
        target.reset().expect("reset");
        let (ei, et) = (init.local_endpoint(), target.local_endpoint());
        init.connect(&et).expect("reconnect");
        target.connect(&ei).expect("reconnect");
        // SAFETY: as above.
        unsafe { init.post_write(&again) }.expect("post after reconnect");
        let (s, r) = pump(&mut init, &mut target, &mut mem, 1);
        assert!(s[0].ok(), "{:?}", s[0]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].imm(), 7);
        assert_eq!(&zc[..100], &data2[..]);
    }

    #[test]
    fn chain_translates_field_by_field() {
        let a = [1u8; 64];
        let b = [2u8; 64];
        let sges1 = [
            Sge {
                addr: a.as_ptr() as u64,
                length: 64,
                lkey: 0x11,
            },
            Sge {
                addr: b.as_ptr() as u64 + 8,
                length: 16,
                lkey: 0, // resolved below
            },
        ];
        let sges2 = [Sge {
            addr: a.as_ptr() as u64,
            length: 8,
            lkey: 0x22,
        }];
        let mut w1 = SendWr::rdma_write(1, &sges1, 0x1000, 0xaa);
        let w2 = SendWr::rdma_write(2, &sges2, 0x2000, 0xbb).with_imm(0x0102_0304);
        w1.next = &w2;
        let mut regs = BTreeMap::new();
        regs.insert((b.as_ptr() as u64, 0x33), 64);
        regs.insert((b.as_ptr() as u64 + 64, 0x44), 64);
        // SAFETY: the chain and its SGEs are live locals.
        let batch = unsafe { translate_chain(&w1, 16, 4, |p, l| lookup_lkey(&regs, p, l)) }
            .expect("translate");
        assert_eq!(batch.wrs.len(), 2);
        let (x1, x2) = (&batch.wrs[0], &batch.wrs[1]);
        assert_eq!(x1.wr_id, 1);
        assert_eq!(x1.next.cast_const(), &batch.wrs[1] as *const ibv_send_wr);
        assert!(x2.next.is_null());
        assert_eq!(x1.opcode, ibv_wr_opcode::IBV_WR_RDMA_WRITE);
        assert_eq!(x1.send_flags, 0);
        assert_eq!(x2.opcode, ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(x2.send_flags, rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0);
        // SAFETY: reading the members written by `translate_chain`.
        unsafe {
            assert_eq!(x1.wr.rdma.remote_addr, 0x1000);
            assert_eq!(x1.wr.rdma.rkey, 0xaa);
            assert_eq!(x2.wr.rdma.remote_addr, 0x2000);
            assert_eq!(x2.wr.rdma.rkey, 0xbb);
            assert_eq!(
                x2.imm_data_invalidated_rkey_union.imm_data,
                0x0102_0304u32.to_be()
            );
        }
        assert_eq!(x1.num_sge, 2);
        // SAFETY: `sg_list` points at `num_sge` entries inside `batch`.
        let s1 = unsafe { std::slice::from_raw_parts(x1.sg_list, 2) };
        assert_eq!(
            (s1[0].addr, s1[0].length, s1[0].lkey),
            (sges1[0].addr, 64, 0x11)
        );
        assert_eq!(
            (s1[1].addr, s1[1].length, s1[1].lkey),
            (sges1[1].addr, 16, 0x33)
        );
        // SAFETY: as above.
        let s2 = unsafe { std::slice::from_raw_parts(x2.sg_list, 1) };
        assert_eq!((s2[0].length, s2[0].lkey), (8, 0x22));

        // Byte-identical layouts: the abi structures could be handed to verbs as they are.
        // SAFETY: both are 128-byte plain-data structures.
        let raw: [u8; 128] = unsafe { std::mem::transmute_copy(&w2) };
        // SAFETY: as above.
        let mut mine: ibv_send_wr = unsafe { std::mem::zeroed() };
        mine.wr_id = 2;
        mine.sg_list = sges2.as_ptr().cast_mut().cast();
        mine.num_sge = 1;
        mine.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        mine.send_flags = rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        mine.imm_data_invalidated_rkey_union.imm_data = 0x0102_0304u32.to_be();
        mine.wr.rdma = rdma_t {
            remote_addr: 0x2000,
            rkey: 0xbb,
        };
        // SAFETY: as above.
        let raw_mine: [u8; 128] = unsafe { std::mem::transmute_copy(&mine) };
        assert_eq!(raw[..52], raw_mine[..52]);
    }

    #[test]
    fn bad_chains_are_refused_before_posting() {
        let a = [0u8; 8];
        let sges = [Sge {
            addr: a.as_ptr() as u64,
            length: 8,
            lkey: 0,
        }];
        let none = BTreeMap::new();
        let wr = SendWr::rdma_write(1, &sges, 0, 1);
        // SAFETY: live locals.
        let e = unsafe { translate_chain(&wr, 16, 4, |p, l| lookup_lkey(&none, p, l)) };
        assert!(
            matches!(e, Err(TransportError::InvalidWr(m)) if m.contains("no local registration"))
        );
        let mut wr = SendWr::rdma_write(1, &sges, 0, 1);
        wr.opcode = 4; // IBV_WR_RDMA_READ
        // SAFETY: live locals.
        let e = unsafe { translate_chain(&wr, 16, 4, |_, _| Some(1)) };
        assert!(matches!(e, Err(TransportError::InvalidWr(m)) if m.contains("opcode")));
        let many = [sges[0]; 5];
        let wr = SendWr::rdma_write(1, &many, 0, 1);
        // SAFETY: live locals.
        let e = unsafe { translate_chain(&wr, 16, 4, |_, _| Some(1)) };
        assert!(matches!(e, Err(TransportError::InvalidWr(_))));
        let mut w1 = SendWr::rdma_write(1, &sges, 0, 1);
        let w2 = SendWr::rdma_write(2, &sges, 0, 1);
        w1.next = &w2;
        // SAFETY: live locals.
        let e = unsafe { translate_chain(&w1, 1, 4, |_, _| Some(1)) };
        assert!(matches!(e, Err(TransportError::InvalidWr(m)) if m.contains("chain")));
    }

    #[test]
    fn lkey_lookup_needs_a_covering_registration() {
        let mut regs = BTreeMap::new();
        regs.insert((0x1000, 7), 0x1000); // 0x1000..0x2000
        regs.insert((0x1800, 8), 0x100); // 0x1800..0x1900
        assert_eq!(lookup_lkey(&regs, 0x1000, 0x1000), Some(7));
        assert_eq!(lookup_lkey(&regs, 0x1800, 0x80), Some(8));
        assert_eq!(lookup_lkey(&regs, 0x1880, 0x200), Some(7));
        assert_eq!(lookup_lkey(&regs, 0x1f00, 0x200), None);
        assert_eq!(lookup_lkey(&regs, 0x800, 0x10), None);
        assert_eq!(lookup_lkey(&regs, u64::MAX, 2), None);
    }

    #[test]
    fn completions_convert_to_the_abi_view() {
        // SAFETY: ibv_wc is plain data.
        let mut raw: ibv_wc = unsafe { std::mem::zeroed() };
        raw.wr_id = 0x1_0000_0005;
        raw.status = wc_status::SUCCESS;
        raw.opcode = wc_opcode::RECV_RDMA_WITH_IMM;
        raw.byte_len = 4096;
        raw.imm_data_invalidated_rkey_union.imm_data = 77u32.to_be();
        raw.qp_num = 12;
        raw.wc_flags = ibv_wc_flags::IBV_WC_WITH_IMM.0;
        let wc = wc_from_ibv(&raw, wc_opcode::RECV_RDMA_WITH_IMM);
        assert!(wc.ok());
        assert_eq!(
            (wc.wr_id, wc.opcode, wc.byte_len, wc.imm(), wc.qp_num),
            (0x1_0000_0005, wc_opcode::RECV_RDMA_WITH_IMM, 4096, 77, 12)
        );
        assert_eq!(wc.wc_flags, 2);
        // Byte-identical to the verbs structure for a successful completion.
        // SAFETY: both are 48-byte plain-data structures.
        let (a, b): ([u8; 48], [u8; 48]) = unsafe {
            (
                std::mem::transmute_copy(&raw),
                std::mem::transmute_copy(&wc),
            )
        };
        assert_eq!(a, b);

        raw.status = wc_status::REM_ACCESS_ERR;
        raw.opcode = 0xdead; // undefined on error
        raw.vendor_err = 0x88;
        let wc = wc_from_ibv(&raw, wc_opcode::RDMA_WRITE);
        assert_eq!(wc.status, wc_status::REM_ACCESS_ERR);
        assert_eq!(wc.opcode, wc_opcode::RDMA_WRITE);
        assert_eq!((wc.vendor_err, wc.byte_len, wc.imm()), (0x88, 0, 0));
    }

    #[test]
    fn endpoint_round_trips_through_serde() {
        let e = VerbsEndpoint {
            qpn: 0x1234,
            psn: 0xabcdef,
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            mtu: ibv_mtu::IBV_MTU_4096,
        };
        let s = serde_json::to_string(&e).expect("serialize");
        let back: VerbsEndpoint = serde_json::from_str(&s).expect("deserialize");
        assert_eq!(back, e);
    }

    #[test]
    fn owned_buffers_are_page_aligned_and_zeroed() {
        let b = OwnedBuf::zeroed(5000).expect("alloc");
        assert_eq!(b.ptr.as_ptr() as usize % PAGE, 0);
        assert_eq!(b.layout.size(), 8192);
        // SAFETY: 8192 zeroed bytes owned by `b`.
        let bytes = unsafe { std::slice::from_raw_parts(b.ptr.as_ptr(), 8192) };
        assert!(bytes.iter().all(|&x| x == 0));
    }
}
