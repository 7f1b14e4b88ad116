//! The KV page pool and its integrity tags.
//!
//! # Spec
//! - The pool holds `n_pages` physical pages; each page backs `page_size` token slots of K and V
//!   for every layer, stored as the geometry's [`KvType`] (f16, or llama.cpp's q8_0 blocks).
//! - Each page has a tag: `generation` (bumped at every allocation, so a [`PageRef`] taken in an
//!   earlier allocation can never match again), `owner` (the request id that holds it, or
//!   [`NO_OWNER`] while free) and, per layer, `filled` (slots `0..filled` were written in this
//!   generation).
//! - Allocation is all-or-nothing and resets `filled` to 0 on every layer; pages are *not* zeroed
//!   (the tag check makes stale bytes unreadable; zero-on-release is a later option).
//! - Writes go through [`PagePool::write_slot`], which checks the tag (generation and owner) and
//!   requires `slot == filled` (append-only): an out-of-order write could otherwise leave an
//!   unwritten hole below `filled`.
//! - Reads go through [`PagePool::attend`], the only read of K/V this crate offers: it hands
//!   `custody_kernels::attention::paged_attention` the pool's *own* tags and memory, and the
//!   kernel checks every page's tag before it reads a slot. The K/V arrays are private; nothing
//!   else can reach them except the transfer path, through capabilities the pool mints from its
//!   own tags and re-checks at every use (a [`SendGrant`] to read a held, written page's bytes,
//!   a [`LandGrant`] to land bytes in a reservation's pages: see "Capabilities" below), the raw
//!   addresses a NIC registers ([`PagePool::source_regions`]: reading through them is `unsafe`)
//!   and, only with the `test-oracle` feature, the tests' oracle.
//! - An engine lends its pool out only as a [`PoolView`] (tags and counts, granted reads).
//! - Release requires the caller's generation and owner to match, and clears the owner.
//!
//! Safety property 2 ("no early reuse") for local writers: a page is on the free list only after
//! `release`, and its owner's later writes then fail the owner check. Remote writers (transfers)
//! add quarantine on top of this in the transport layer.

use custody_kernels::attention::{
    self, AttentionArgs, AttnScratch, IntegrityError, ReduceOrder, TagCheck, TagView,
};
/// The kernel's page geometry, page references and readers, as the pool's API names them.
pub use custody_kernels::attention::{KvType, PageGeometry, PageRef, Reader};
use custody_kernels::attention::{words_as_bytes, words_as_bytes_mut};

/// Most destinations [`PagePool::land_dests`] hands out at once (the transport's bound).
pub use custody_transport::MAX_LAND_DESTS;

/// Owner value of a free page. Request ids start at 1; namespace tags have the top bit set.
pub use custody_kernels::attention::NO_OWNER;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("KV pool exhausted: {wanted} pages wanted, {free} free of {total}")]
    Exhausted {
        wanted: usize,
        free: usize,
        total: usize,
    },
    #[error("share of page {page} generation {generation} by {owner:#x} refused: {why}")]
    BadShare {
        page: u32,
        generation: u32,
        owner: u64,
        why: &'static str,
    },
    #[error(
        "release of page {page} generation {generation} by {owner:#x} refused: tag has generation {tag_generation}, owner {tag_owner:#x}"
    )]
    BadRelease {
        page: u32,
        generation: u32,
        owner: u64,
        tag_generation: u32,
        tag_owner: u64,
    },
}

/// Source of [`PagePool::id`]s.
static NEXT_POOL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The paged KV cache of all layers plus the page tags.
#[derive(Debug)]
pub struct PagePool {
    /// This pool's identity (unique in the process): a [`SendGrant`] or [`LandGrant`] minted by
    /// one pool is refused by every other.
    id: u64,
    geom: PageGeometry,
    n_pages: usize,
    /// Per layer, the K (V) cache's words ([`PageGeometry`] says how a row is stored).
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
    generation: Vec<u32>,
    owner: Vec<u64>,
    /// `filled[layer][page]`
    filled: Vec<Vec<u32>>,
    /// In-band stamp per page: who the data was last written for (see `TagView`).
    stamp_owner: Vec<u64>,
    stamp_generation: Vec<u32>,
    /// Per page: (slots, checksum) of the last transfer header that landed in it.
    landed: Vec<(u32, u64)>,
    /// Per page: the header area of its transfer region, as bytes land in it directly
    /// ([`PagePool::land_dest`]); decoded by [`PagePool::land_done`].
    hdr_area: Vec<[u8; TRANSFER_HDR_BYTES]>,
    release_fill: ReleaseFill,
    /// Free pages (a stack: the most recently released page is reused first, which is the
    /// worst case for stale reads and so the right default for exercising the tag check).
    free: Vec<u32>,
    /// Pages whose tag (any field, any layer's `filled`) changed since a device last took them
    /// ([`PagePool::take_tag_changes`]): how a device backend keeps its copy of the tags current
    /// by uploading only those. Every tag write goes through [`PagePool::tag_changed`].
    changed: TagChanges,
}

/// A set of page indices, bounded by the pool's pages (a mark per page and the marked list).
#[derive(Debug)]
struct TagChanges {
    marked: Vec<bool>,
    pages: Vec<u32>,
}

impl PagePool {
    /// A pool of `n_pages` pages of `geom` for `n_layers` layers. Memory is allocated zeroed
    /// (lazily, by the OS) once here and never again.
    pub fn new(geom: PageGeometry, n_layers: usize, n_pages: usize) -> Self {
        assert!(n_pages > 0 && n_pages < u32::MAX as usize);
        assert!(
            geom.kv.supports(geom.head_dim),
            "{:?} cannot store rows of {}",
            geom.kv,
            geom.head_dim
        );
        let words = n_pages * geom.page_words();
        Self {
            id: NEXT_POOL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            geom,
            n_pages,
            // Zeroed through the allocator's zero-allocation path (`calloc`: pages are mapped
            // lazily, so a large pool costs nothing until used).
            k: (0..n_layers).map(|_| vec![0u16; words]).collect(),
            v: (0..n_layers).map(|_| vec![0u16; words]).collect(),
            generation: vec![0; n_pages],
            owner: vec![NO_OWNER; n_pages],
            filled: vec![vec![0; n_pages]; n_layers],
            free: (0..n_pages as u32).rev().collect(),
            stamp_owner: vec![NO_OWNER; n_pages],
            stamp_generation: vec![0; n_pages],
            landed: vec![(0, 0); n_pages],
            hdr_area: vec![[0; TRANSFER_HDR_BYTES]; n_pages],
            release_fill: ReleaseFill::None,
            // Every page is "changed" at first: a device's copy starts from nothing.
            changed: TagChanges {
                marked: vec![true; n_pages],
                pages: (0..n_pages as u32).collect(),
            },
        }
    }

    /// What released pages are overwritten with (default: nothing — the tag check makes stale
    /// bytes unreadable; zeroing is defence in depth with a measured cost).
    pub fn set_release_fill(&mut self, fill: ReleaseFill) {
        self.release_fill = fill;
    }

    /// Layers of the pool.
    pub(crate) fn n_layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes of one layer's K (or V) part of a page.
    fn page_layer_bytes(&self) -> usize {
        self.geom.page_words() * 2
    }

    /// Bytes a page takes in a transfer region: the in-band header, then per layer K then V.
    pub fn region_page_stride(&self) -> usize {
        TRANSFER_HDR_BYTES + 2 * self.n_layers() * self.page_layer_bytes()
    }

    /// The chunks a transfer of `slots` filled slots of `page` consists of, in transfer (and
    /// checksum) order: `f(offset_in_region_page, bytes)`. Full pages go as one chunk per layer
    /// and K/V; a partial page as one chunk per KV head (only the filled slots travel).
    /// Private: outside this module page bytes are reached only through a [`SendGrant`]
    /// ([`PagePool::transfer_chunks`]).
    fn for_each_transfer_chunk(&self, page: u32, slots: usize, mut f: impl FnMut(usize, &[u8])) {
        let g = self.geom;
        assert!(slots <= g.page_size && (page as usize) < self.n_pages);
        let p = page as usize;
        let lb = self.page_layer_bytes();
        for layer in 0..self.n_layers() {
            for (kv, cache) in [(0, &self.k[layer]), (1, &self.v[layer])] {
                let chunk_base = TRANSFER_HDR_BYTES + (2 * layer + kv) * lb;
                let bytes = words_as_bytes(cache);
                if slots == g.page_size {
                    let off = g.offset(p, 0, 0) * 2;
                    f(chunk_base, &bytes[off..off + lb]);
                } else {
                    for h in 0..g.n_kv_heads {
                        let off = g.offset(p, h, 0) * 2;
                        let within = (h * g.page_size * g.row_words()) * 2;
                        f(
                            chunk_base + within,
                            &bytes[off..off + slots * g.row_words() * 2],
                        );
                    }
                }
            }
        }
    }

    /// The checksum of `slots` slots of `page` as they are in this pool.
    fn page_checksum(&self, page: u32, slots: usize) -> u64 {
        let mut h = custody_kernels::checksum::Checksummer::new();
        self.for_each_transfer_chunk(page, slots, |_, b| h.update(b));
        h.digest()
    }

    /// A transfer landed `bytes` at `offset` of page `page`'s region layout (the NIC's DMA). No
    /// tag changes: the slots count as written only after [`PagePool::verify_landed`]. The
    /// header area must be written whole; data must not straddle a layer's K/V chunk.
    fn land(&mut self, page: u32, offset: usize, bytes: &[u8]) -> Result<(), LandError> {
        let p = page as usize;
        if p >= self.n_pages {
            return Err(LandError(format!("page {page} outside the pool")));
        }
        if offset < TRANSFER_HDR_BYTES {
            if offset != 0 || bytes.len() != TRANSFER_HDR_BYTES {
                return Err(LandError("partial header write".into()));
            }
            let h = TransferHeader::decode(bytes)?;
            self.tag_changed(p);
            self.stamp_owner[p] = h.owner;
            self.stamp_generation[p] = h.generation;
            self.landed[p] = (h.slots, h.checksum);
            return Ok(());
        }
        let lb = self.page_layer_bytes();
        let rel = offset - TRANSFER_HDR_BYTES;
        if rel + bytes.len() > 2 * self.n_layers() * lb
            || !bytes.len().is_multiple_of(2)
            || !rel.is_multiple_of(2)
        {
            return Err(LandError(format!(
                "write of {} B at page offset {offset} is outside the page or misaligned",
                bytes.len()
            )));
        }
        // A gathered write may span several layers' K/V chunks: split it at chunk boundaries.
        let base = self.geom.offset(p, 0, 0) * 2;
        let (mut pos, mut rest) = (rel, bytes);
        while !rest.is_empty() {
            let (chunk, within) = (pos / lb, pos % lb);
            let n = (lb - within).min(rest.len());
            let (layer, kv) = (chunk / 2, chunk % 2);
            let cache = if kv == 0 {
                &mut self.k[layer]
            } else {
                &mut self.v[layer]
            };
            words_as_bytes_mut(cache)[base + within..base + within + n].copy_from_slice(&rest[..n]);
            rest = &rest[n..];
            pos += n;
        }
        Ok(())
    }

    /// Direct landing (a transport reading from its wire straight into the pool): the longest
    /// contiguous destination of at most `max_len` bytes at `offset` of page `page`'s region
    /// layout — the header area, or part of one layer's K or V chunk. Bytes written there are
    /// data (never tags); a header takes effect only in [`PagePool::land_done`].
    fn land_dest(
        &mut self,
        page: u32,
        offset: usize,
        max_len: usize,
    ) -> Result<&mut [u8], LandError> {
        let p = page as usize;
        let lb = self.page_layer_bytes();
        if p >= self.n_pages || offset >= TRANSFER_HDR_BYTES + 2 * self.n_layers() * lb {
            return Err(LandError(format!(
                "write at page {page} offset {offset} is outside the pool"
            )));
        }
        if max_len == 0 {
            return Err(LandError("empty destination requested".into()));
        }
        if offset < TRANSFER_HDR_BYTES {
            let end = TRANSFER_HDR_BYTES.min(offset + max_len);
            return Ok(&mut self.hdr_area[p][offset..end]);
        }
        let rel = offset - TRANSFER_HDR_BYTES;
        let (chunk, within) = (rel / lb, rel % lb);
        let n = (lb - within).min(max_len);
        let (layer, kv) = (chunk / 2, chunk % 2);
        let base = self.geom.offset(p, 0, 0) * 2;
        let cache = if kv == 0 {
            &mut self.k[layer]
        } else {
            &mut self.v[layer]
        };
        Ok(&mut words_as_bytes_mut(cache)[base + within..base + within + n])
    }

    /// Direct landing, gathered: the destinations (at most [`MAX_LAND_DESTS`]) of up to
    /// `max_len` bytes at `offset` of page `page`'s region layout, in order, appended to `out`
    /// — so that a transport can fill them with one vectored read.
    fn land_dests<'a>(
        &'a mut self,
        page: u32,
        offset: usize,
        max_len: usize,
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<(), LandError> {
        let p = page as usize;
        let lb = self.page_layer_bytes();
        let page_len = TRANSFER_HDR_BYTES + 2 * self.n_layers() * lb;
        if p >= self.n_pages || offset >= page_len {
            return Err(LandError(format!(
                "write at page {page} offset {offset} is outside the pool"
            )));
        }
        if max_len == 0 {
            return Err(LandError("empty destination requested".into()));
        }
        let base = self.geom.offset(p, 0, 0) * 2;
        let end = page_len.min(offset + max_len);
        let limit = out.len() + MAX_LAND_DESTS;
        let mut pos = offset;
        if pos < TRANSFER_HDR_BYTES {
            let e = TRANSFER_HDR_BYTES.min(end);
            out.push(&mut self.hdr_area[p][pos..e]);
            pos = e;
        }
        if pos >= end {
            return Ok(());
        }
        let first_chunk = (pos - TRANSFER_HDR_BYTES) / lb;
        for (layer, (k, v)) in self.k.iter_mut().zip(self.v.iter_mut()).enumerate() {
            for (kv, cache) in [(0, k), (1, v)] {
                let c = 2 * layer + kv;
                if c < first_chunk {
                    continue;
                }
                let chunk_start = TRANSFER_HDR_BYTES + c * lb;
                if chunk_start >= end || out.len() >= limit {
                    return Ok(());
                }
                let within = pos - chunk_start;
                let n = (lb - within).min(end - pos);
                out.push(&mut words_as_bytes_mut(cache)[base + within..base + within + n]);
                pos += n;
            }
        }
        Ok(())
    }

    /// Direct landing finished `len` bytes at `offset` of page `page`'s region layout: a header
    /// area written whole is decoded now (exactly as [`PagePool::land`] does); a partly written
    /// header area is an error.
    fn land_done(&mut self, page: u32, offset: usize, len: usize) -> Result<(), LandError> {
        let p = page as usize;
        if p >= self.n_pages {
            return Err(LandError(format!("page {page} outside the pool")));
        }
        if offset >= TRANSFER_HDR_BYTES || len == 0 {
            return Ok(());
        }
        if offset != 0 || len < TRANSFER_HDR_BYTES {
            return Err(LandError("partial header write".into()));
        }
        let h = TransferHeader::decode(&self.hdr_area[p])?;
        self.tag_changed(p);
        self.stamp_owner[p] = h.owner;
        self.stamp_generation[p] = h.generation;
        self.landed[p] = (h.slots, h.checksum);
        Ok(())
    }

    /// Slot count of the last transfer header that landed in `page`.
    pub fn landed_slots(&self, page: u32) -> u32 {
        self.landed[page as usize].0
    }

    /// Checksum of the last transfer header that landed in `page`.
    pub fn landed_checksum(&self, page: u32) -> u64 {
        self.landed[page as usize].1
    }

    /// Verify a landed transfer for `owner` at `pr`: the in-band header must name this owner and
    /// generation and `slots` slots, and the checksum of what landed must match the header's.
    /// Only then are slots `0..slots` marked written on every layer.
    pub fn verify_landed(
        &mut self,
        pr: PageRef,
        owner: u64,
        slots: usize,
        check_checksum: bool,
    ) -> Result<(), VerifyError> {
        let p = pr.page as usize;
        if p >= self.n_pages || self.generation[p] != pr.generation || self.owner[p] != owner {
            return Err(VerifyError::Tag { page: pr.page });
        }
        if self.stamp_owner[p] != owner || self.stamp_generation[p] != pr.generation {
            return Err(VerifyError::Stamp {
                page: pr.page,
                owner: self.stamp_owner[p],
                generation: self.stamp_generation[p],
            });
        }
        let (hdr_slots, hdr_sum) = self.landed[p];
        if hdr_slots as usize != slots || slots > self.geom.page_size {
            return Err(VerifyError::Slots {
                page: pr.page,
                header: hdr_slots,
                expected: slots as u32,
            });
        }
        if check_checksum {
            let got = self.page_checksum(pr.page, slots);
            if got != hdr_sum {
                return Err(VerifyError::Checksum {
                    page: pr.page,
                    header: hdr_sum,
                    computed: got,
                });
            }
        }
        for f in &mut self.filled {
            if f[p] != 0 {
                return Err(VerifyError::AlreadyWritten { page: pr.page });
            }
        }
        self.tag_changed(p);
        for f in &mut self.filled {
            f[p] = slots as u32;
        }
        Ok(())
    }

    /// Bytes of KV storage one token slot takes over all layers.
    pub fn bytes_per_token(geom: PageGeometry, n_layers: usize) -> usize {
        2 * n_layers * geom.n_kv_heads * geom.row_words() * std::mem::size_of::<u16>()
    }

    pub fn geometry(&self) -> PageGeometry {
        self.geom
    }
    pub fn n_pages(&self) -> usize {
        self.n_pages
    }
    pub fn n_free(&self) -> usize {
        self.free.len()
    }
    pub fn page_size(&self) -> usize {
        self.geom.page_size
    }

    /// Allocate `n` pages for `owner`, all or nothing. Bumps each page's generation.
    pub fn alloc(&mut self, owner: u64, n: usize) -> Result<Vec<PageRef>, PoolError> {
        assert_ne!(owner, NO_OWNER, "owner id 0 is reserved for free pages");
        if n > self.free.len() {
            return Err(PoolError::Exhausted {
                wanted: n,
                free: self.free.len(),
                total: self.n_pages,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(page) = self.free.pop() else {
                unreachable!("checked above")
            };
            let p = page as usize;
            debug_assert_eq!(self.owner[p], NO_OWNER, "free page {page} has an owner");
            self.tag_changed(p);
            self.generation[p] = self.generation[p].wrapping_add(1);
            self.owner[p] = owner;
            for f in &mut self.filled {
                f[p] = 0;
            }
            out.push(PageRef {
                page,
                generation: self.generation[p],
            });
        }
        Ok(out)
    }

    /// Release pages held by `owner`. Every page's tag must match (else nothing is released).
    pub fn release(&mut self, owner: u64, pages: &[PageRef]) -> Result<(), PoolError> {
        for pr in pages {
            let p = pr.page as usize;
            if p >= self.n_pages || self.generation[p] != pr.generation || self.owner[p] != owner {
                return Err(PoolError::BadRelease {
                    page: pr.page,
                    generation: pr.generation,
                    owner,
                    tag_generation: self.generation.get(p).copied().unwrap_or(0),
                    tag_owner: self.owner.get(p).copied().unwrap_or(NO_OWNER),
                });
            }
        }
        for pr in pages {
            let p = pr.page as usize;
            self.tag_changed(p);
            self.owner[p] = NO_OWNER;
            if let Some(value) = self.release_fill.value() {
                let r = self.geom.offset(p, 0, 0)..self.geom.offset(p + 1, 0, 0);
                for l in 0..self.k.len() {
                    self.k[l][r.clone()].fill(value);
                    self.v[l][r.clone()].fill(value);
                }
                self.stamp_owner[p] = NO_OWNER;
            }
            self.free.push(pr.page);
        }
        debug_assert!(self.free.len() <= self.n_pages);
        Ok(())
    }

    /// Hand pages `owner` holds to a namespace as read-only shared pages (a prefix cache's):
    /// each must be `owner`'s in its generation, written whole on every layer, and last written
    /// for `owner` (its in-band stamp); then its owner and stamp become `shared` — a tag no
    /// request id equals, so every later write of the page is refused by the write's own check,
    /// and only readers naming `shared` pass the read's. All or nothing. The generation is
    /// unchanged: the holders' block tables stay valid. Released (evicted) by `shared`.
    pub fn share(
        &mut self,
        owner: u64,
        pages: &[PageRef],
        shared: std::num::NonZeroU64,
    ) -> Result<(), PoolError> {
        assert_ne!(owner, shared.get(), "a namespace tag equal to a request id");
        let ps = self.geom.page_size as u32;
        for pr in pages {
            let p = pr.page as usize;
            let refuse = |why| {
                Err(PoolError::BadShare {
                    page: pr.page,
                    generation: pr.generation,
                    owner,
                    why,
                })
            };
            if p >= self.n_pages || self.generation[p] != pr.generation || self.owner[p] != owner {
                return refuse("not the owner's page in this generation");
            }
            if self.filled.iter().any(|f| f[p] != ps) {
                return refuse("not written whole on every layer");
            }
            if self.stamp_owner[p] != owner || self.stamp_generation[p] != pr.generation {
                return refuse("its data was last written for someone else");
            }
        }
        for pr in pages {
            let p = pr.page as usize;
            self.tag_changed(p);
            self.owner[p] = shared.get();
            self.stamp_owner[p] = shared.get();
        }
        Ok(())
    }

    /// Write K and V of one token into `slot` of page `pr` at `layer`, for `owner`.
    pub fn write_slot(
        &mut self,
        layer: usize,
        pr: PageRef,
        slot: usize,
        owner: u64,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), IntegrityError> {
        self.write_slot_checked(layer, pr, slot, owner, TagCheck::Enforced, k, v)
    }

    /// [`PagePool::write_slot`], with the incident reproduction's switch: when the tag check is
    /// disabled, a write may land beyond `filled` (as the incident's decode wrote after slots
    /// nobody had filled); ownership and generation are still checked.
    #[allow(clippy::too_many_arguments)]
    pub fn write_slot_checked(
        &mut self,
        layer: usize,
        pr: PageRef,
        slot: usize,
        owner: u64,
        check: TagCheck,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), IntegrityError> {
        self.claim_slot_checked(layer, pr, slot, owner, check)?;
        let p = pr.page as usize;
        attention::write_kv_slot(
            &mut self.k[layer],
            &mut self.v[layer],
            self.geom,
            p,
            slot,
            k,
            v,
        );
        Ok(())
    }

    /// The write's tag check and its effect on the tags, without the data: `slot` of page `pr`
    /// at `layer` becomes written for `owner` (in-band stamp set, `filled` advanced) if the
    /// write may land — the same rules as [`PagePool::write_slot_checked`], which calls it. A
    /// device backend calls it for each row before its KV-write kernel stores the bytes in the
    /// device pool (the bytes of this pool are then unused).
    pub fn claim_slot_checked(
        &mut self,
        layer: usize,
        pr: PageRef,
        slot: usize,
        owner: u64,
        check: TagCheck,
    ) -> Result<(), IntegrityError> {
        let p = pr.page as usize;
        if p >= self.n_pages {
            return Err(IntegrityError::PageOutOfRange {
                page: pr.page,
                n_pages: self.n_pages,
            });
        }
        if self.generation[p] != pr.generation {
            return Err(IntegrityError::StaleGeneration {
                page: pr.page,
                expected: pr.generation,
                found: self.generation[p],
            });
        }
        if self.owner[p] != owner {
            return Err(IntegrityError::ForeignOwner {
                page: pr.page,
                generation: pr.generation,
                expected: owner,
                found: self.owner[p],
            });
        }
        let filled = self.filled[layer][p];
        let in_order = slot == filled as usize
            || (check == TagCheck::DisabledForIncidentReproduction && slot > filled as usize);
        if !in_order || slot >= self.geom.page_size {
            return Err(IntegrityError::OutOfOrderWrite {
                page: pr.page,
                slot: slot as u32,
                filled,
            });
        }
        self.tag_changed(p);
        self.stamp_owner[p] = owner;
        self.stamp_generation[p] = pr.generation;
        self.filled[layer][p] = slot as u32 + 1;
        Ok(())
    }

    /// Page `page`'s K and V of `layer` in host memory (the words of the page's
    /// `[kv_head][slot][dim]` block), for a device backend's staging: the CUDA backend copies a
    /// page's device K/V here before the transfer path reads it, and from here after a transfer
    /// landed in it. Never a read path of the engine (the engine reads only through `attend` or
    /// the device's checked attention).
    pub(crate) fn host_page_kv_mut(&mut self, layer: usize, page: u32) -> (&mut [u16], &mut [u16]) {
        let e = self.geom.page_words();
        let r = page as usize * e..(page as usize + 1) * e;
        (&mut self.k[layer][r.clone()], &mut self.v[layer][r])
    }

    /// Note that page `p`'s tag is about to change (every tag write calls it first).
    fn tag_changed(&mut self, p: usize) {
        if !self.changed.marked[p] {
            self.changed.marked[p] = true;
            self.changed.pages.push(p as u32);
        }
        debug_assert!(self.changed.pages.len() <= self.n_pages);
    }

    /// The pages whose tag changed since the last call (all of them at the first), ascending;
    /// the set is emptied. A device backend uploads these pages' tags and nothing else.
    pub(crate) fn take_tag_changes(&mut self) -> Vec<u32> {
        let mut pages = std::mem::take(&mut self.changed.pages);
        for &p in &pages {
            self.changed.marked[p as usize] = false;
        }
        pages.sort_unstable();
        pages
    }

    /// Tag arrays of `layer` for the attention kernel.
    pub(crate) fn tags(&self, layer: usize) -> TagView<'_> {
        TagView {
            generation: &self.generation,
            owner: &self.owner,
            filled: &self.filled[layer],
            stamp_owner: &self.stamp_owner,
            stamp_generation: &self.stamp_generation,
        }
    }

    /// Causal paged attention of one sequence over `layer` — the pool's one read of K/V. The
    /// kernel gets this pool's tags and memory (never a caller's), checks every page of
    /// `read.block_table` first, and on a mismatch returns the error without reading a slot or
    /// touching `out`.
    pub fn attend(
        &self,
        layer: usize,
        read: &AttendRead<'_>,
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<(), IntegrityError> {
        let args = AttentionArgs {
            q: read.q,
            n_heads: read.n_heads,
            start_pos: read.start_pos,
            k_cache: &self.k[layer],
            v_cache: &self.v[layer],
            geom: self.geom,
            block_table: read.block_table,
            tags: self.tags(layer),
            reader: read.reader,
            order: read.order,
            check: read.check,
        };
        attention::paged_attention(&args, out, scratch)
    }

    /// Where the K/V storage lives, layer by layer (K then V): for a transport to register as
    /// the source of one-sided writes (a NIC reads it). Raw addresses, not slices: reading
    /// through them is the transport's `unsafe` contract, never a read path of the engine.
    pub fn source_regions(&self) -> Vec<SourceRegion> {
        self.k
            .iter()
            .zip(&self.v)
            .flat_map(|(k, v)| [k, v])
            .map(|c| SourceRegion {
                addr: c.as_ptr().cast(),
                len_bytes: std::mem::size_of_val(&c[..]),
            })
            .collect()
    }

    /// Test oracle (feature `test-oracle`, enabled only by the test crate): the raw K bytes of
    /// `page` at `layer` (layout `[kv_head][slot][row]`, little-endian words), read *without* the
    /// tag check — what a component with the incident's bug would attend over.
    #[cfg(feature = "test-oracle")]
    pub fn test_oracle_k_page_bytes(&self, layer: usize, page: u32) -> Vec<u8> {
        let g = self.geom;
        let r = g.offset(page as usize, 0, 0)..g.offset(page as usize + 1, 0, 0);
        self.k[layer][r]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect()
    }

    /// The current tag of `page`.
    pub fn tag(&self, page: u32) -> PageTag {
        let p = page as usize;
        PageTag {
            generation: self.generation[p],
            owner: self.owner[p],
            filled: self.filled[0][p],
        }
    }

    /// Fault injection (feature `fault-injection`, tests only): overwrite a page's tag fields
    /// as a buggy or malicious component could, to prove that the read-side check catches it.
    #[cfg(feature = "fault-injection")]
    pub fn fault_inject_set_tag(&mut self, page: u32, generation: u32, owner: u64) {
        self.tag_changed(page as usize);
        self.generation[page as usize] = generation;
        self.owner[page as usize] = owner;
    }
}

/// # Offload: a shared page's bytes out, a verified page's bytes in
///
/// A prefix-cache page the cache evicts may leave as bytes ([`PagePool::export_shared`]: only a
/// page owned by the namespace named, whole, last written for it); bytes come back only as a
/// [`crate::offload::seal::VerifiedPage`] — which only `offload::seal::open` makes, after its MAC,
/// model, geometry, chain key and namespace checks — through [`PagePool::restore`].
impl PagePool {
    /// The K/V of shared page `pr` of namespace `tag`, in transfer order (per layer K then V),
    /// for an offload tier. Refused unless `pr` is `tag`'s in its generation, written whole on
    /// every layer and stamped `tag`.
    pub fn export_shared(
        &self,
        pr: PageRef,
        tag: std::num::NonZeroU64,
    ) -> Result<Vec<u8>, PoolError> {
        let p = pr.page as usize;
        let refuse = |why| {
            Err(PoolError::BadShare {
                page: pr.page,
                generation: pr.generation,
                owner: tag.get(),
                why,
            })
        };
        if p >= self.n_pages || self.generation[p] != pr.generation || self.owner[p] != tag.get() {
            return refuse("export: not the namespace's page in this generation");
        }
        let ps = self.geom.page_size as u32;
        if self.filled.iter().any(|f| f[p] != ps) || self.stamp_owner[p] != tag.get() {
            return refuse("export: not written whole for the namespace");
        }
        let mut out = Vec::with_capacity(2 * self.n_layers() * self.page_layer_bytes());
        self.for_each_transfer_chunk(pr.page, self.geom.page_size, |_, b| {
            out.extend_from_slice(b)
        });
        Ok(out)
    }

    /// Restore a verified page as a shared page of namespace `tag` (the reader's chain's: under
    /// the unsafe token-only reproduction, possibly not the page's own): a free page is taken
    /// (its generation bumped), its bytes written, every slot marked written on every layer and
    /// its stamp set to `tag`. The caller records it as written by the page's original writer.
    pub fn restore(
        &mut self,
        page: &crate::offload::seal::VerifiedPage,
        tag: std::num::NonZeroU64,
    ) -> Result<PageRef, PoolError> {
        let body = page.body();
        let lb = self.page_layer_bytes();
        assert_eq!(
            body.len(),
            2 * self.n_layers() * lb,
            "a verified page is one page of this pool's layout"
        );
        let pr = self.alloc(tag.get(), 1)?[0];
        let p = pr.page as usize;
        let base = self.geom.offset(p, 0, 0) * 2;
        for (chunk, bytes) in body.chunks_exact(lb).enumerate() {
            let (layer, kv) = (chunk / 2, chunk % 2);
            let cache = if kv == 0 {
                &mut self.k[layer]
            } else {
                &mut self.v[layer]
            };
            words_as_bytes_mut(cache)[base..base + lb].copy_from_slice(bytes);
        }
        self.tag_changed(p);
        self.stamp_owner[p] = tag.get();
        self.stamp_generation[p] = pr.generation;
        let ps = self.geom.page_size as u32;
        for f in &mut self.filled {
            f[p] = ps;
        }
        Ok(pr)
    }
}

/// # Capabilities: the only ways page bytes leave or enter the pool
///
/// Outside this module, page bytes are read for a transfer only with a [`SendGrant`] and
/// written by a transfer only with a [`LandGrant`] (through a [`Landing`]). Both are minted by
/// the pool from its own tags — a send grant only for pages a reader holds in their current
/// generation, written whole up to the slots it names and last written for their holder; a land
/// grant only for pages an owner holds, unwritten — and both are re-checked against the tags in
/// release builds at every use, so a grant outliving its pages (released, reallocated) reads
/// and writes nothing. Their fields are private: no code outside this module can forge one.
/// An engine's pool is never lent out as `&PagePool` or `&mut PagePool` (see
/// [`crate::engine::Engine::pool`], [`PoolView`]), so for an engine's pool the grants are minted
/// only by the engine's own roles: [`crate::PrefillEngine::send_grant`] for a held (prefilled)
/// sequence, [`crate::DecodeEngine::reserve_import`] for a reservation.
impl PagePool {
    /// Mint the capability to read, for a transfer, the first `n_written` slots of `pages` (a
    /// block table `reader` holds). Every page that holds any of those slots must be in its
    /// generation, owned by a tag `reader` admits, last written for that tag, and written on
    /// every layer at least up to the slots it holds.
    pub fn grant_send(
        &self,
        reader: &Reader,
        pages: &[PageRef],
        n_written: usize,
    ) -> Result<SendGrant, GrantError> {
        let ps = self.geom.page_size;
        let n = n_written.div_ceil(ps);
        if n > pages.len() {
            return Err(GrantError::TooFewPages {
                needed: n,
                held: pages.len(),
            });
        }
        let mut out = Vec::with_capacity(n);
        for (idx, &pr) in pages.iter().enumerate().take(n) {
            let slots = (n_written - idx * ps).min(ps) as u32;
            let p = pr.page as usize;
            self.check_generation(pr)?;
            let owner = self.owner[p];
            if !reader.admits(owner) {
                return Err(GrantError::NotHeld {
                    page: pr.page,
                    owner,
                });
            }
            if self.stamp_owner[p] != owner || self.stamp_generation[p] != pr.generation {
                return Err(GrantError::NotWrittenForHolder { page: pr.page });
            }
            if let Some(filled) = self.filled.iter().map(|f| f[p]).find(|&f| f < slots) {
                return Err(GrantError::Unwritten {
                    page: pr.page,
                    slots,
                    filled,
                });
            }
            out.push(GrantedPage { pr, slots, owner });
        }
        Ok(SendGrant {
            pool: self.id,
            pages: out,
        })
    }

    /// Mint the capability to land transfers in `pages`, which `owner` holds (freshly
    /// allocated: nothing written on any layer).
    pub fn grant_land(&self, owner: u64, pages: &[PageRef]) -> Result<LandGrant, GrantError> {
        for &pr in pages {
            self.check_generation(pr)?;
            let p = pr.page as usize;
            if self.owner[p] != owner {
                return Err(GrantError::NotHeld {
                    page: pr.page,
                    owner: self.owner[p],
                });
            }
            if self.filled.iter().any(|f| f[p] != 0) {
                return Err(GrantError::AlreadyWritten { page: pr.page });
            }
        }
        Ok(LandGrant {
            pool: self.id,
            owner,
            pages: pages.to_vec(),
        })
    }

    fn check_generation(&self, pr: PageRef) -> Result<(), GrantError> {
        let p = pr.page as usize;
        if p >= self.n_pages {
            return Err(GrantError::OutOfRange { page: pr.page });
        }
        if self.generation[p] != pr.generation {
            return Err(GrantError::Stale {
                page: pr.page,
                generation: pr.generation,
                found: self.generation[p],
            });
        }
        Ok(())
    }

    /// Page `idx` of `grant`, if the grant is this pool's and the page still carries the tag it
    /// was granted under (checked in every build: this is the read's only gate).
    fn check_send(&self, grant: &SendGrant, idx: usize) -> Result<GrantedPage, GrantError> {
        if grant.pool != self.id {
            return Err(GrantError::OtherPool);
        }
        let g = *grant.pages.get(idx).ok_or(GrantError::Index {
            idx,
            len: grant.pages.len(),
        })?;
        self.check_generation(g.pr)?;
        let owner = self.owner[g.pr.page as usize];
        if owner != g.owner {
            return Err(GrantError::NotHeld {
                page: g.pr.page,
                owner,
            });
        }
        Ok(g)
    }

    /// The chunks of granted page `idx`, in transfer (and checksum) order:
    /// `f(offset_in_region_page, bytes)` (see [`TransferHeader`] for the region layout).
    pub fn transfer_chunks(
        &self,
        grant: &SendGrant,
        idx: usize,
        f: impl FnMut(usize, &[u8]),
    ) -> Result<(), GrantError> {
        let g = self.check_send(grant, idx)?;
        self.for_each_transfer_chunk(g.pr.page, g.slots as usize, f);
        Ok(())
    }

    /// The transfer checksum of granted page `idx` as it is in this pool.
    pub fn transfer_checksum(&self, grant: &SendGrant, idx: usize) -> Result<u64, GrantError> {
        let g = self.check_send(grant, idx)?;
        Ok(self.page_checksum(g.pr.page, g.slots as usize))
    }

    /// Page `idx` of `grant` for a landing, if the grant is this pool's and its owner still
    /// holds the page in the granted generation (checked in every build).
    fn check_land(&self, grant: &LandGrant, idx: usize) -> Result<u32, LandError> {
        let refuse = |why: String| Err(LandError(why));
        if grant.pool != self.id {
            return refuse("the reservation is another pool's".into());
        }
        let Some(&pr) = grant.pages.get(idx) else {
            return refuse(format!(
                "page index {idx} outside the reservation ({} pages)",
                grant.pages.len()
            ));
        };
        let p = pr.page as usize;
        if self.generation[p] != pr.generation || self.owner[p] != grant.owner {
            return refuse(format!(
                "page {} no longer belongs to the reservation (generation {} owner {:#x}, \
                 reserved {} for {:#x})",
                pr.page, self.generation[p], self.owner[p], pr.generation, grant.owner
            ));
        }
        Ok(pr.page)
    }

    /// The landing side of this pool: transfers land only through it, each with its
    /// reservation's [`LandGrant`].
    pub fn landing(&mut self) -> Landing<'_> {
        Landing { pool: self }
    }

    /// A read-only view of the tags and counts (what an engine lends out).
    pub fn view(&self) -> PoolView<'_> {
        PoolView { pool: self }
    }
}

/// The capability to read granted pages' bytes for a transfer (see the capabilities section of
/// [`PagePool`]'s docs). Not `Clone`: one per transfer.
#[derive(Debug)]
pub struct SendGrant {
    pool: u64,
    pages: Vec<GrantedPage>,
}

impl SendGrant {
    /// The granted pages in block-table order.
    pub fn pages(&self) -> &[GrantedPage] {
        &self.pages
    }
}

/// One page of a [`SendGrant`]: which page, in which generation, and how many slots may be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantedPage {
    pr: PageRef,
    slots: u32,
    /// The tag owner it was granted under (the reader or one of its namespaces).
    owner: u64,
}

impl GrantedPage {
    pub fn page(&self) -> PageRef {
        self.pr
    }
    pub fn slots(&self) -> usize {
        self.slots as usize
    }
}

/// The capability to land transfers in a reservation's pages. Not `Clone`.
#[derive(Debug)]
pub struct LandGrant {
    pool: u64,
    owner: u64,
    pages: Vec<PageRef>,
}

impl LandGrant {
    /// The reserved pages in block-table order.
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }
    /// The request the reservation is for.
    pub fn owner(&self) -> u64 {
        self.owner
    }
}

/// Why a grant was not minted, or not honoured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("page {page} is outside the pool")]
    OutOfRange { page: u32 },
    #[error("page {page}: granted for generation {generation}, the page is in {found}")]
    Stale {
        page: u32,
        generation: u32,
        found: u32,
    },
    #[error("page {page} is held by {owner:#x}, not by the grant's holder")]
    NotHeld { page: u32, owner: u64 },
    #[error("page {page}: its data was last written for someone else")]
    NotWrittenForHolder { page: u32 },
    #[error("page {page}: {slots} slots asked, {filled} written on some layer")]
    Unwritten { page: u32, slots: u32, filled: u32 },
    #[error("page {page}: already written in this generation")]
    AlreadyWritten { page: u32 },
    #[error("{needed} pages needed for the slots, {held} held")]
    TooFewPages { needed: usize, held: usize },
    #[error("page index {idx} outside the grant ({len} pages)")]
    Index { idx: usize, len: usize },
    #[error("the grant was minted by another pool")]
    OtherPool,
}

/// The landing side of a pool (a transport's target memory writes through it). Every method
/// takes the reservation's [`LandGrant`] and a page index in it, and refuses a page the
/// reservation no longer holds. Landing writes only bytes and the per-page landed header; a
/// page's slots count as written only after [`PagePool::verify_landed`].
#[derive(Debug)]
pub struct Landing<'a> {
    pool: &'a mut PagePool,
}

impl<'a> Landing<'a> {
    /// Bytes of a page's part of a transfer region.
    pub fn region_page_stride(&self) -> usize {
        self.pool.region_page_stride()
    }

    /// A transfer landed `bytes` at `offset` of reserved page `idx`'s region layout (the NIC's
    /// DMA). The header area must be written whole; data may span layers' K/V chunks.
    pub fn land(
        &mut self,
        grant: &LandGrant,
        idx: usize,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), LandError> {
        let page = self.pool.check_land(grant, idx)?;
        self.pool.land(page, offset, bytes)
    }

    /// Direct landing: the longest contiguous destination of at most `max_len` bytes at
    /// `offset` of reserved page `idx`'s region layout. Bytes written there are data; a header
    /// takes effect only in [`Landing::land_done`].
    pub fn land_dest(
        &mut self,
        grant: &LandGrant,
        idx: usize,
        offset: usize,
        max_len: usize,
    ) -> Result<&mut [u8], LandError> {
        let page = self.pool.check_land(grant, idx)?;
        self.pool.land_dest(page, offset, max_len)
    }

    /// Direct landing, gathered: up to [`MAX_LAND_DESTS`] destinations of up to `max_len`
    /// bytes at `offset` of reserved page `idx`'s region layout, appended to `out`.
    pub fn land_dests<'b>(
        &'b mut self,
        grant: &LandGrant,
        idx: usize,
        offset: usize,
        max_len: usize,
        out: &mut Vec<&'b mut [u8]>,
    ) -> Result<(), LandError> {
        let page = self.pool.check_land(grant, idx)?;
        self.pool.land_dests(page, offset, max_len, out)
    }

    /// Direct landing finished `len` bytes at `offset` of reserved page `idx`: a header area
    /// written whole is decoded now; a partly written one is an error.
    pub fn land_done(
        &mut self,
        grant: &LandGrant,
        idx: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), LandError> {
        let page = self.pool.check_land(grant, idx)?;
        self.pool.land_done(page, offset, len)
    }
}

/// A read-only view of a pool: its geometry, counts and tags, the headers that landed, and the
/// granted transfer reads. No page bytes without a [`SendGrant`]; no `&PagePool`.
#[derive(Clone, Copy, Debug)]
pub struct PoolView<'a> {
    pool: &'a PagePool,
}

impl<'a> PoolView<'a> {
    pub fn geometry(&self) -> PageGeometry {
        self.pool.geom
    }
    pub fn n_pages(&self) -> usize {
        self.pool.n_pages
    }
    pub fn n_free(&self) -> usize {
        self.pool.free.len()
    }
    pub fn page_size(&self) -> usize {
        self.pool.geom.page_size
    }
    /// Bytes a page takes in a transfer region.
    pub fn region_page_stride(&self) -> usize {
        self.pool.region_page_stride()
    }
    /// The current tag of `page`.
    pub fn tag(&self, page: u32) -> PageTag {
        self.pool.tag(page)
    }
    /// Slot count of the last transfer header that landed in `page`.
    pub fn landed_slots(&self, page: u32) -> u32 {
        self.pool.landed_slots(page)
    }
    /// Checksum of the last transfer header that landed in `page`.
    pub fn landed_checksum(&self, page: u32) -> u64 {
        self.pool.landed_checksum(page)
    }
    /// See [`PagePool::transfer_chunks`].
    pub fn transfer_chunks(
        &self,
        grant: &SendGrant,
        idx: usize,
        f: impl FnMut(usize, &[u8]),
    ) -> Result<(), GrantError> {
        self.pool.transfer_chunks(grant, idx, f)
    }
    /// See [`PagePool::transfer_checksum`].
    pub fn transfer_checksum(&self, grant: &SendGrant, idx: usize) -> Result<u64, GrantError> {
        self.pool.transfer_checksum(grant, idx)
    }
    /// See [`PagePool::source_regions`].
    pub fn source_regions(&self) -> Vec<SourceRegion> {
        self.pool.source_regions()
    }
    /// Test oracle: see [`PagePool::test_oracle_k_page_bytes`].
    #[cfg(feature = "test-oracle")]
    pub fn test_oracle_k_page_bytes(&self, layer: usize, page: u32) -> Vec<u8> {
        self.pool.test_oracle_k_page_bytes(layer, page)
    }
}

/// A page's tag as a view shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageTag {
    pub generation: u32,
    pub owner: u64,
    /// Slots written on layer 0.
    pub filled: u32,
}

/// One read of [`PagePool::attend`]: a sequence's queries and the pages it claims.
#[derive(Clone, Copy, Debug)]
pub struct AttendRead<'a> {
    /// `n_q × n_heads × head_dim`; query `i` is at position `start_pos + i`.
    pub q: &'a [f32],
    pub n_heads: usize,
    pub start_pos: usize,
    pub block_table: &'a [PageRef],
    /// The reader: every page must be one it admits (its own, or a shared page of a namespace
    /// it names), in the block table's generation.
    pub reader: Reader,
    pub order: ReduceOrder,
    /// Always [`TagCheck::Enforced`] outside the incident reproduction.
    pub check: TagCheck,
}

/// A contiguous piece of the pool's K/V storage, for registration with a transport.
#[derive(Clone, Copy, Debug)]
pub struct SourceRegion {
    pub addr: *const u8,
    pub len_bytes: usize,
}

/// Size of the in-band header at the start of each page in a transfer region.
pub const TRANSFER_HDR_BYTES: usize = 64;
const TRANSFER_MAGIC: u32 = 0x4b56_5047; // "KVPG"

/// The in-band page header a transfer writes after the page's data: whose data it is (the
/// decode-side request and page generation), how many slots, and the checksum of the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferHeader {
    pub owner: u64,
    pub generation: u32,
    pub slots: u32,
    pub checksum: u64,
}

impl TransferHeader {
    pub fn encode(&self) -> [u8; TRANSFER_HDR_BYTES] {
        let mut b = [0u8; TRANSFER_HDR_BYTES];
        b[0..4].copy_from_slice(&TRANSFER_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.generation.to_le_bytes());
        b[8..16].copy_from_slice(&self.owner.to_le_bytes());
        b[16..20].copy_from_slice(&self.slots.to_le_bytes());
        b[24..32].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }
    pub fn decode(b: &[u8]) -> Result<Self, LandError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        if b.len() != TRANSFER_HDR_BYTES || u32_at(0) != TRANSFER_MAGIC {
            return Err(LandError("bad transfer header".into()));
        }
        Ok(Self {
            generation: u32_at(4),
            owner: u64_at(8),
            slots: u32_at(16),
            checksum: u64_at(24),
        })
    }
}

/// A landing the pool refused (reported to the sender as a remote access error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("transfer landing refused: {0}")]
pub struct LandError(pub String);

/// A landed transfer that failed verification: its slots are not marked written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("page {page}: the tag no longer names this request and generation")]
    Tag { page: u32 },
    #[error(
        "page {page}: in-band header names owner {owner:#x} generation {generation}, not this request"
    )]
    Stamp {
        page: u32,
        owner: u64,
        generation: u32,
    },
    #[error("page {page}: header says {header} slots, the protocol expects {expected}")]
    Slots {
        page: u32,
        header: u32,
        expected: u32,
    },
    #[error("page {page}: checksum mismatch (header {header:#018x}, computed {computed:#018x})")]
    Checksum {
        page: u32,
        header: u64,
        computed: u64,
    },
    #[error("page {page}: slots already written in this generation")]
    AlreadyWritten { page: u32 },
}

/// What a released page is overwritten with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseFill {
    #[default]
    None,
    Zero,
    /// A recognisable non-finite pattern (every word 0x7E5A: an f16 NaN, and a q8_0 block whose
    /// scale is that NaN): a stale read that slipped past
    /// every check would poison the output visibly instead of leaking plausible content.
    Canary,
}

impl ReleaseFill {
    /// The word every word of a released page is set to.
    fn value(self) -> Option<u16> {
        match self {
            ReleaseFill::None => None,
            ReleaseFill::Zero => Some(0),
            ReleaseFill::Canary => Some(0x7E5A),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: PageGeometry = PageGeometry {
        page_size: 4,
        n_kv_heads: 1,
        head_dim: 2,
        kv: KvType::F16,
    };

    /// The change log a device copies from: every page at first, then exactly the pages whose
    /// tag an allocation, a claim or a release changed — each once, ascending — and nothing
    /// after it was taken.
    #[test]
    fn tag_changes_name_exactly_the_pages_whose_tag_changed() {
        let mut pool = PagePool::new(G, 2, 5);
        assert_eq!(pool.take_tag_changes(), vec![0, 1, 2, 3, 4]);
        assert!(pool.take_tag_changes().is_empty());
        let a = pool.alloc(1, 2).expect("alloc");
        let mut want: Vec<u32> = a.iter().map(|p| p.page).collect();
        want.sort_unstable();
        assert_eq!(pool.take_tag_changes(), want);
        pool.claim_slot_checked(1, a[1], 0, 1, TagCheck::Enforced)
            .expect("claim");
        pool.claim_slot_checked(0, a[1], 0, 1, TagCheck::Enforced)
            .expect("claim");
        assert_eq!(pool.take_tag_changes(), vec![a[1].page]);
        // A refused claim changes nothing.
        assert!(
            pool.claim_slot_checked(0, a[0], 0, 9, TagCheck::Enforced)
                .is_err()
        );
        assert!(pool.take_tag_changes().is_empty());
        pool.release(1, &a).expect("release");
        assert_eq!(pool.take_tag_changes(), want);
    }

    #[test]
    fn alloc_bumps_generation_and_release_clears_owner() {
        let mut pool = PagePool::new(G, 2, 3);
        let a = pool.alloc(1, 2).expect("alloc");
        assert_eq!(pool.n_free(), 1);
        assert!(matches!(
            pool.alloc(2, 2),
            Err(PoolError::Exhausted {
                wanted: 2,
                free: 1,
                total: 3
            })
        ));
        assert_eq!(pool.n_free(), 1, "a failed alloc takes nothing");
        pool.release(1, &a).expect("release");
        let b = pool.alloc(2, 1).expect("alloc");
        assert_eq!(b[0].page, a[1].page, "LIFO reuse");
        assert_eq!(b[0].generation, a[1].generation + 1);
        assert!(pool.release(1, &b).is_err(), "a foreign release is refused");
        assert!(
            pool.release(2, &a[1..]).is_err(),
            "a stale release is refused"
        );
    }

    #[test]
    fn shared_pages_are_read_only_and_readable_by_their_namespace_only() {
        let g = PageGeometry {
            page_size: 2,
            n_kv_heads: 1,
            head_dim: 2,
            kv: KvType::F16,
        };
        let mut pool = PagePool::new(g, 1, 3);
        let a = pool.alloc(7, 2).expect("alloc");
        let kv = [1.0, 2.0];
        let ns = std::num::NonZeroU64::new(0x8000_0000_0000_0abc).unwrap();
        // Not written whole: refused.
        pool.write_slot(0, a[0], 0, 7, &kv, &kv).expect("write");
        assert!(matches!(
            pool.share(7, &a[..1], ns),
            Err(PoolError::BadShare { .. })
        ));
        pool.write_slot(0, a[0], 1, 7, &kv, &kv).expect("write");
        assert!(matches!(
            pool.share(8, &a[..1], ns),
            Err(PoolError::BadShare { .. })
        ));
        pool.share(7, &a[..1], ns).expect("share");
        assert_eq!(
            pool.tag(a[0].page),
            PageTag {
                generation: a[0].generation,
                owner: ns.get(),
                filled: 2
            }
        );
        // Read-only: its writer's write is refused by the write's own owner check.
        assert!(matches!(
            pool.write_slot(0, a[0], 1, 7, &kv, &kv),
            Err(IntegrityError::ForeignOwner { .. })
        ));
        // Readable by a reader naming the namespace; not by its writer alone, nor another.
        let q = [0.5f32; 2];
        let read = |pool: &PagePool, reader| {
            let mut out = [0f32; 2];
            pool.attend(
                0,
                &AttendRead {
                    q: &q,
                    n_heads: 1,
                    start_pos: 1,
                    block_table: &a[..1],
                    reader,
                    order: ReduceOrder::Vec,
                    check: TagCheck::Enforced,
                },
                &mut out,
                &mut AttnScratch::default(),
            )
        };
        let other = std::num::NonZeroU64::new(0x8000_0000_0000_0def).unwrap();
        read(&pool, Reader::with_shared(9, &[ns])).expect("the namespace reads");
        assert!(matches!(
            read(&pool, Reader::private(7)),
            Err(IntegrityError::ForeignOwner { .. })
        ));
        assert!(matches!(
            read(&pool, Reader::with_shared(7, &[other])),
            Err(IntegrityError::ForeignOwner { .. })
        ));
        // Released (evicted) by the namespace only.
        assert!(pool.release(7, &a[..1]).is_err());
        pool.release(ns.get(), &a[..1]).expect("evict");
        assert_eq!(pool.n_free(), 2);
    }

    /// Fill `slots` slots of every layer of `pages` for `owner`.
    fn fill(pool: &mut PagePool, owner: u64, pages: &[PageRef], slots: usize) {
        let kv = [1.0, 2.0];
        for layer in 0..pool.n_layers() {
            for (i, &pr) in pages.iter().enumerate() {
                let n = slots.saturating_sub(i * G.page_size).min(G.page_size);
                for slot in 0..n {
                    pool.write_slot(layer, pr, slot, owner, &kv, &kv)
                        .expect("write");
                }
            }
        }
    }

    #[test]
    fn send_grants_name_held_written_pages_and_die_with_them() {
        let mut pool = PagePool::new(G, 2, 4);
        let a = pool.alloc(7, 2).expect("alloc");
        fill(&mut pool, 7, &a, 6);
        let reader = Reader::private(7);
        // Not the holder, more slots than written, more pages than held: refused at the mint.
        assert!(matches!(
            pool.grant_send(&Reader::private(8), &a, 6),
            Err(GrantError::NotHeld { .. })
        ));
        assert!(matches!(
            pool.grant_send(&reader, &a, 7),
            Err(GrantError::Unwritten { .. })
        ));
        assert!(matches!(
            pool.grant_send(&reader, &a, 9),
            Err(GrantError::TooFewPages { .. })
        ));
        let grant = pool.grant_send(&reader, &a, 6).expect("grant");
        assert_eq!(grant.pages().len(), 2);
        assert_eq!((grant.pages()[0].slots(), grant.pages()[1].slots()), (4, 2));
        let mut bytes = 0;
        pool.transfer_chunks(&grant, 1, |_, b| bytes += b.len())
            .expect("granted");
        assert_eq!(
            bytes,
            2 * 2 * 2 * G.head_dim * 2,
            "2 slots × K,V × 2 layers × f16"
        );
        assert_eq!(
            pool.transfer_checksum(&grant, 0),
            Ok(pool.page_checksum(a[0].page, 4))
        );
        // Another pool refuses it, even for the same page numbers and generations.
        let mut other = PagePool::new(G, 2, 4);
        let b = other.alloc(7, 2).expect("alloc");
        fill(&mut other, 7, &b, 6);
        assert_eq!(
            other.transfer_chunks(&grant, 0, |_, _| {}),
            Err(GrantError::OtherPool)
        );
        // Released and reallocated: the grant reads nothing (a plain check, in every build).
        pool.release(7, &a).expect("release");
        assert!(matches!(
            pool.transfer_chunks(&grant, 0, |_, _| panic!("read after release")),
            Err(GrantError::NotHeld { .. })
        ));
        let c = pool.alloc(9, 2).expect("alloc");
        fill(&mut pool, 9, &c, 8);
        assert!(matches!(
            pool.transfer_chunks(&grant, 1, |_, _| panic!("read after reuse")),
            Err(GrantError::Stale { .. })
        ));
        assert!(pool.transfer_checksum(&grant, 5).is_err());
    }

    #[test]
    fn land_grants_land_only_in_the_reservations_pages() {
        let mut pool = PagePool::new(G, 1, 4);
        let a = pool.alloc(7, 2).expect("alloc");
        let grant = pool.grant_land(7, &a).expect("grant");
        assert!(matches!(
            pool.grant_land(8, &a),
            Err(GrantError::NotHeld { .. })
        ));
        let data = [0u8; 8];
        let at = TRANSFER_HDR_BYTES;
        pool.landing().land(&grant, 1, at, &data).expect("lands");
        assert!(
            pool.landing().land(&grant, 2, at, &data).is_err(),
            "index outside"
        );
        let mut other = PagePool::new(G, 1, 4);
        let b = other.alloc(7, 2).expect("alloc");
        assert_eq!(b, a, "same pages and generations in another pool");
        assert!(other.landing().land(&grant, 0, at, &data).is_err());
        // The reservation ended and its pages went to someone else: nothing lands, in any build.
        pool.release(7, &a).expect("release");
        let c = pool.alloc(9, 2).expect("alloc");
        assert_eq!(c[0].page, a[1].page);
        let mut landing = pool.landing();
        assert!(landing.land(&grant, 1, at, &data).is_err());
        assert!(landing.land_dest(&grant, 1, at, 8).is_err());
        assert!(landing.land_done(&grant, 1, 0, TRANSFER_HDR_BYTES).is_err());
        let mut out = Vec::new();
        assert!(landing.land_dests(&grant, 0, at, 8, &mut out).is_err());
        assert!(out.is_empty());
    }

    #[test]
    fn writes_are_append_only_and_tag_checked() {
        let mut pool = PagePool::new(G, 1, 2);
        let a = pool.alloc(7, 1).expect("alloc");
        let kv = [1.0, 2.0];
        assert!(matches!(
            pool.write_slot(0, a[0], 1, 7, &kv, &kv),
            Err(IntegrityError::OutOfOrderWrite { .. })
        ));
        pool.write_slot(0, a[0], 0, 7, &kv, &kv).expect("write");
        assert!(matches!(
            pool.write_slot(0, a[0], 0, 7, &kv, &kv),
            Err(IntegrityError::OutOfOrderWrite { .. })
        ));
        assert!(matches!(
            pool.write_slot(0, a[0], 1, 8, &kv, &kv),
            Err(IntegrityError::ForeignOwner { .. })
        ));
        let stale = PageRef {
            page: a[0].page,
            generation: a[0].generation - 1,
        };
        assert!(matches!(
            pool.write_slot(0, stale, 1, 7, &kv, &kv),
            Err(IntegrityError::StaleGeneration { .. })
        ));
        assert_eq!(
            pool.tag(a[0].page),
            PageTag {
                generation: a[0].generation,
                owner: 7,
                filled: 1
            }
        );
    }
}
