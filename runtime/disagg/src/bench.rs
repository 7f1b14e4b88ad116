//! Benchmarks of the transfer path, each measured against a reference in the same run: the tcp
//! transport on loopback vs a plain memcpy of the same bytes, with and without the checksum.

use crate::transport::Discard;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use custody_kernels::attention::{PageGeometry, Reader};

use crate::kv::{LandGrant, PagePool, SendGrant, TransferHeader};
use crate::transport::abi::Wc;
use crate::transport::tcp::TcpTransport;
use crate::transport::{AccessError, KvTransport};

/// One measurement: seconds of each repetition for each variant (the caller's statistics
/// summarise them: one `median` for every benchmark, in the binary's `bench::stats`).
#[derive(Clone, Debug)]
pub struct TransferBench {
    pub bytes: u64,
    pub memcpy_s: Vec<f64>,
    pub transfer_s: Vec<f64>,
    /// Checksums computed by the sender before the transfer (as the prefill node does, at
    /// prefill completion), verified by the receiver as each page lands.
    pub transfer_checksum_s: Vec<f64>,
    /// Worst case: the sender hashes each page inside the timed transfer, right before posting.
    pub transfer_checksum_inline_s: Vec<f64>,
    pub checksum_only_s: Vec<f64>,
    /// The plaintext connection's connect (TCP and the pairing proof).
    pub connect_s: f64,
    /// The same transfers over a TLS connection, alternating with the plaintext ones.
    pub encrypted: Option<EncryptedBench>,
}

/// The encrypted rig's figures (`[disagg] transport_encryption = true`).
#[derive(Clone, Debug)]
pub struct EncryptedBench {
    /// Connect: TCP, the TLS handshake, the pairing proof inside it.
    pub connect_s: f64,
    pub transfer_s: Vec<f64>,
    pub transfer_checksum_s: Vec<f64>,
}

impl TransferBench {
    pub fn gbps(&self, s: f64) -> f64 {
        self.bytes as f64 / s / 1e9
    }
}

/// CPU seconds this process has used, all threads, user and system (`CLOCK_PROCESS_CPUTIME_ID`):
/// includes BPF programs run in its threads' context and any collector thread it hosts.
pub fn process_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write; the clock exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "CLOCK_PROCESS_CPUTIME_ID");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Pin every thread of this process (read from `/proc/self/task`, named by `comm`):
/// `Some((a, b))` puts the threads `on_b` picks on CPU `b` and every other on CPU `a`; `None`
/// lets every thread run on every CPU again. A thread that exits meanwhile is skipped.
pub fn pin_threads(
    cpus: Option<(usize, usize)>,
    on_b: impl Fn(&str) -> bool,
) -> std::io::Result<()> {
    // Not `available_parallelism`: that is the calling thread's affinity, which this narrows.
    // SAFETY: sysconf has no preconditions.
    let n_cpus = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap_or(1);
    for entry in std::fs::read_dir("/proc/self/task")? {
        let entry = entry?;
        let Some(tid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        match cpus {
            Some((a, b)) => {
                let cpu = if on_b(comm.trim()) { b } else { a };
                assert!(cpu < n_cpus, "CPU {cpu} of {n_cpus}");
                // SAFETY: a CPU index below CPU_SETSIZE into a live set.
                unsafe { libc::CPU_SET(cpu, &mut set) };
            }
            None => {
                for c in 0..n_cpus {
                    // SAFETY: as above.
                    unsafe { libc::CPU_SET(c, &mut set) };
                }
            }
        }
        // SAFETY: a thread id of this process and a valid set of its size.
        let rc =
            unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
    }
    Ok(())
}

type RegReply = std::sync::mpsc::Sender<(u32, u64, Vec<u32>)>;

/// Both ends' encryption for an encrypted [`TransferRig`].
#[derive(Clone, Debug)]
pub struct RigTls {
    pub target: crate::transport::KvEncryption,
    pub initiator: crate::transport::KvEncryption,
}

/// A prefill-to-decode transfer set up once and run many times: `n_pages` full pages of `geom` ×
/// `n_layers` from a source pool to a receiving pool over the tcp transport on loopback (one
/// connection, kept warm), the receiver on its own thread. Each [`TransferRig::transfer`] is one
/// timed transfer, posted as the prefill node posts (one chain per page: its gathered chunks
/// and its header with the immediate data) and complete when every page's completion arrived.
pub struct TransferRig {
    geom: PageGeometry,
    src: PagePool,
    /// The source pages, as the capability to read them for a transfer.
    grant: SendGrant,
    stride: usize,
    bytes: u64,
    connect_s: f64,
    init: TcpTransport,
    tx_reg: Option<std::sync::mpsc::Sender<(bool, RegReply)>>,
    stop: Arc<AtomicBool>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl TransferRig {
    /// `tls`: encrypt the connection (the target's and the initiator's [`KvEncryption`]);
    /// `None`: plaintext. Either way the connection proves a pairing first, as the nodes do.
    pub fn new(geom: PageGeometry, n_layers: usize, n_pages: usize, tls: Option<RigTls>) -> Self {
        assert!(n_pages > 0);
        let mut src = PagePool::new(geom, n_layers, n_pages);
        let owner = 7;
        let pages = src.alloc(owner, n_pages).expect("alloc");
        // Fill the source pages with data.
        let kvd = geom.n_kv_heads * geom.head_dim;
        let row: Vec<f32> = (0..kvd).map(|i| (i as f32 * 0.37).sin()).collect();
        for l in 0..n_layers {
            for pr in &pages {
                for s in 0..geom.page_size {
                    src.write_slot(l, *pr, s, owner, &row, &row).expect("write");
                }
            }
        }
        let stride = src.region_page_stride();
        let grant = src
            .grant_send(&Reader::private(owner), &pages, n_pages * geom.page_size)
            .expect("grant");
        let mut bytes = 0u64;
        src.transfer_chunks(&grant, 0, |_, b| bytes += b.len() as u64)
            .expect("granted");
        bytes *= n_pages as u64;

        // Transport: target thread lands into `dst`, verifying when asked.
        let mut target = TcpTransport::new(2);
        let mut init = TcpTransport::new(1);
        if let Some(t) = tls {
            target.set_encryption(t.target).expect("target encryption");
            init.set_encryption(t.initiator)
                .expect("initiator encryption");
        }
        let addr: SocketAddr = target
            .listen("127.0.0.1:0".parse().expect("addr"))
            .expect("listen");
        let pairing = target.pair().expect("pair");
        let t0 = Instant::now();
        init.connect(addr, &pairing).expect("connect");
        let connect_s = t0.elapsed().as_secs_f64();
        let pairing = pairing.id();
        let (tx_reg, rx_reg) = std::sync::mpsc::channel::<(bool, RegReply)>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let n = n_pages;
        let worker = std::thread::spawn(move || {
            let mut dst = PagePool::new(geom, n_layers, n);
            let mut regions: HashMap<u32, LandGrant> = HashMap::new();
            while let Ok((verify, reply)) = rx_reg.recv() {
                let dpages = dst.alloc(9, n).expect("alloc");
                let region = target
                    .register((stride * n) as u64, pairing)
                    .expect("register");
                regions.insert(region.rkey, dst.grant_land(9, &dpages).expect("grant"));
                let gens: Vec<u32> = dpages.iter().map(|p| p.generation).collect();
                reply
                    .send((region.rkey, region.base, gens))
                    .discard("the benchmark's sender stopped waiting: the run is over");
                let mut landed = 0;
                let mut wcs = Vec::new();
                while landed < n && !stop2.load(Ordering::Relaxed) {
                    wcs.clear();
                    let regions = &regions;
                    let mut mem = super::PoolLanding {
                        landing: dst.landing(),
                        stride,
                        grant_of: |rkey: u32| {
                            regions
                                .get(&rkey)
                                .ok_or_else(|| AccessError("no region".into()))
                        },
                    };
                    // A few frames per poll (about one page): each page is verified right after
                    // it landed, while its bytes are still in cache.
                    target.poll_recv(&mut mem, &mut wcs, 4).expect("poll");
                    for wc in &wcs {
                        let idx = wc.imm() as usize;
                        if verify {
                            dst.verify_landed(dpages[idx], 9, geom.page_size, true)
                                .expect("verify");
                        }
                        landed += 1;
                    }
                }
                let _proof = target.invalidate(region.rkey).expect("invalidate");
                regions.remove(&region.rkey);
                dst.release(9, &dpages).expect("release");
            }
        });
        Self {
            geom,
            src,
            grant,
            stride,
            bytes,
            connect_s,
            init,
            tx_reg: Some(tx_reg),
            stop,
            worker: Some(worker),
        }
    }

    /// Seconds the initiator's connect took (TCP, TLS when on, the pairing proof).
    pub fn connect_s(&self) -> f64 {
        self.connect_s
    }

    /// Bytes of KV moved per transfer.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// One transfer; returns its wall-clock seconds (from the first post to the last
    /// completion). `verify`: the receiver verifies each page's checksum as it lands;
    /// `precompute`: the sender's checksums are computed before the timed part (as the prefill
    /// node does, at prefill completion), otherwise inside it, right before each page's post.
    pub fn transfer(&mut self, verify: bool, precompute: bool) -> f64 {
        let geom = self.geom;
        let (src, grant, stride) = (&self.src, &self.grant, self.stride);
        let n_pages = grant.pages().len();
        let (rtx, rrx) = std::sync::mpsc::channel();
        self.tx_reg
            .as_ref()
            .expect("rig alive")
            .send((verify, rtx))
            .expect("worker");
        let (rkey, base, gens) = rrx.recv().expect("region");
        let pre: Vec<u64> = if verify && precompute {
            (0..n_pages)
                .map(|i| src.transfer_checksum(grant, i).expect("granted"))
                .collect()
        } else {
            Vec::new()
        };
        let t0 = Instant::now();
        let mut headers: Vec<[u8; crate::kv::TRANSFER_HDR_BYTES]> = Vec::with_capacity(n_pages);
        let mut chains = Vec::with_capacity(n_pages);
        for i in 0..n_pages {
            let checksum = match (verify, pre.get(i)) {
                (false, _) => 0,
                (true, Some(&c)) => c,
                // Inline: each page's checksum inside the timed transfer, before its post.
                (true, None) => src.transfer_checksum(grant, i).expect("granted"),
            };
            headers.push(
                TransferHeader {
                    owner: 9,
                    generation: gens[i],
                    slots: geom.page_size as u32,
                    checksum,
                }
                .encode(),
            );
            let pb = base + (i * stride) as u64;
            chains.push(
                super::page_write_chain(
                    src.view(),
                    grant,
                    i,
                    pb,
                    rkey,
                    i as u64,
                    i as u32,
                    &headers[i],
                )
                .expect("granted"),
            );
        }
        // Posted as the prefill node posts: consecutive pages' chains linked into posts of at
        // most POST_WRS_MAX requests (the transport still writes page-sized pieces, so the
        // sender and the receiver overlap as when each page was posted alone).
        let mut first = 0;
        while first < n_pages {
            let end = super::link_post_group(&mut chains, first);
            // SAFETY: the chunks are in `src` (not modified during the run) and the headers in
            // `headers` (capacity reserved up front: never reallocated), both alive until every
            // completion below; the linked chains and their SGE lists live in `chains`.
            unsafe { self.init.post_write(&chains[first].1[0]) }.expect("post");
            first = end;
        }
        let mut done = 0;
        let mut wcs: Vec<Wc> = Vec::new();
        while done < n_pages {
            wcs.clear();
            self.init.poll_send(&mut wcs, 4096).expect("poll");
            for wc in &wcs {
                assert!(wc.ok(), "transfer failed: {wc:?}");
            }
            done += wcs.len();
            if wcs.is_empty() {
                std::thread::yield_now();
            }
        }
        t0.elapsed().as_secs_f64()
    }
}

impl std::fmt::Debug for TransferRig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferRig")
            .field("pages", &self.grant.pages().len())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Drop for TransferRig {
    fn drop(&mut self) {
        drop(self.tx_reg.take());
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.worker.take()
            && w.join().is_err()
        {
            tracing::error!("the transfer benchmark's landing thread panicked");
        }
    }
}

/// Transfer `n_pages` full pages of `geom` × `n_layers` from one pool to another over the tcp
/// transport on loopback (`reps` times), against a memcpy of the same chunks.
pub fn transfer_bench(
    geom: PageGeometry,
    n_layers: usize,
    n_pages: usize,
    reps: usize,
    tls: Option<RigTls>,
) -> TransferBench {
    assert!(n_pages > 0 && reps > 0);
    let mut rig = TransferRig::new(geom, n_layers, n_pages, None);
    let mut tls_rig = tls.map(|t| TransferRig::new(geom, n_layers, n_pages, Some(t)));
    let (bytes, stride) = (rig.bytes, rig.stride);
    // memcpy reference: the same chunks into a second pool's memory.
    let mut dst_mem = vec![0u8; stride * n_pages];
    let mut memcpy = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        for i in 0..rig.grant.pages().len() {
            rig.src
                .transfer_chunks(&rig.grant, i, |off, b| {
                    dst_mem[i * stride + off..i * stride + off + b.len()].copy_from_slice(b);
                })
                .expect("granted");
        }
        std::hint::black_box(&dst_mem);
        memcpy.push(t0.elapsed().as_secs_f64());
    }
    let mut checksum_only = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        let mut x = 0u64;
        for i in 0..rig.grant.pages().len() {
            x ^= rig.src.transfer_checksum(&rig.grant, i).expect("granted");
        }
        std::hint::black_box(x);
        checksum_only.push(t0.elapsed().as_secs_f64());
    }
    let (mut plain, mut checked, mut inline) = (Vec::new(), Vec::new(), Vec::new());
    let (mut enc, mut enc_checked) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        plain.push(rig.transfer(false, false));
        checked.push(rig.transfer(true, true));
        inline.push(rig.transfer(true, false));
        if let Some(t) = &mut tls_rig {
            enc.push(t.transfer(false, false));
            enc_checked.push(t.transfer(true, true));
        }
    }
    let connect_s = rig.connect_s();
    let encrypted = tls_rig.map(|t| EncryptedBench {
        connect_s: t.connect_s(),
        transfer_s: enc,
        transfer_checksum_s: enc_checked,
    });
    drop(rig);
    TransferBench {
        connect_s,
        encrypted,
        bytes,
        memcpy_s: memcpy,
        transfer_s: plain,
        transfer_checksum_s: checked,
        transfer_checksum_inline_s: inline,
        checksum_only_s: checksum_only,
    }
}
