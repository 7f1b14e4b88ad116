//! The KV page pool and its integrity tags.
//!
//! # Spec
//! - The pool holds `n_pages` physical pages; each page backs `page_size` token slots of K and V
//!   for every layer (f16).
//! - Each page has a tag: `generation` (bumped at every allocation, so a [`PageRef`] taken in an
//!   earlier allocation can never match again), `owner` (the request id that holds it, or
//!   [`NO_OWNER`] while free) and, per layer, `filled` (slots `0..filled` were written in this
//!   generation).
//! - Allocation is all-or-nothing and resets `filled` to 0 on every layer; pages are *not* zeroed
//!   (the tag check makes stale bytes unreadable; zero-on-release is a later option).
//! - Writes go through [`PagePool::write_slot`], which checks the tag (generation and owner) and
//!   requires `slot == filled` (append-only): an out-of-order write could otherwise leave an
//!   unwritten hole below `filled`.
//! - Reads go through `custody_kernels::attention::paged_attention`, which checks the same tags.
//! - Release requires the caller's generation and owner to match, and clears the owner.
//!
//! Safety property 2 ("no early reuse") for local writers: a page is on the free list only after
//! `release`, and its owner's later writes then fail the owner check. Remote writers (transfers)
//! add quarantine on top of this in the transport layer.

use custody_kernels::attention::{self, IntegrityError, PageGeometry, PageRef, TagView};
use half::f16;

/// Owner value of a free page. Request ids start at 1.
pub const NO_OWNER: u64 = 0;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("KV pool exhausted: {wanted} pages wanted, {free} free of {total}")]
    Exhausted {
        wanted: usize,
        free: usize,
        total: usize,
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

/// The paged KV cache of all layers plus the page tags.
#[derive(Debug)]
pub struct PagePool {
    geom: PageGeometry,
    n_pages: usize,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    generation: Vec<u32>,
    owner: Vec<u64>,
    /// `filled[layer][page]`
    filled: Vec<Vec<u32>>,
    /// Free pages (a stack: the most recently released page is reused first, which is the
    /// worst case for stale reads and so the right default for exercising the tag check).
    free: Vec<u32>,
}

impl PagePool {
    /// A pool of `n_pages` pages of `geom` for `n_layers` layers. Memory is allocated zeroed
    /// (lazily, by the OS) once here and never again.
    pub fn new(geom: PageGeometry, n_layers: usize, n_pages: usize) -> Self {
        assert!(n_pages > 0 && n_pages < u32::MAX as usize);
        let elems = n_pages * geom.page_elems();
        Self {
            geom,
            n_pages,
            k: (0..n_layers).map(|_| zeroed_f16(elems)).collect(),
            v: (0..n_layers).map(|_| zeroed_f16(elems)).collect(),
            generation: vec![0; n_pages],
            owner: vec![NO_OWNER; n_pages],
            filled: vec![vec![0; n_pages]; n_layers],
            free: (0..n_pages as u32).rev().collect(),
        }
    }

    /// Bytes of KV storage one token slot takes over all layers.
    pub fn bytes_per_token(geom: PageGeometry, n_layers: usize) -> usize {
        2 * n_layers * geom.n_kv_heads * geom.head_dim * std::mem::size_of::<f16>()
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
            self.owner[pr.page as usize] = NO_OWNER;
            self.free.push(pr.page);
        }
        debug_assert!(self.free.len() <= self.n_pages);
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
        if slot != filled as usize || slot >= self.geom.page_size {
            return Err(IntegrityError::OutOfOrderWrite {
                page: pr.page,
                slot: slot as u32,
                filled,
            });
        }
        attention::write_kv_slot(
            &mut self.k[layer],
            &mut self.v[layer],
            self.geom,
            p,
            slot,
            k,
            v,
        );
        self.filled[layer][p] = filled + 1;
        Ok(())
    }

    /// Tag arrays of `layer` for the attention kernel.
    pub fn tags(&self, layer: usize) -> TagView<'_> {
        TagView {
            generation: &self.generation,
            owner: &self.owner,
            filled: &self.filled[layer],
        }
    }

    pub fn k_cache(&self, layer: usize) -> &[f16] {
        &self.k[layer]
    }
    pub fn v_cache(&self, layer: usize) -> &[f16] {
        &self.v[layer]
    }

    /// The current tag of `page`: (generation, owner, filled on layer 0).
    pub fn tag(&self, page: u32) -> (u32, u64, u32) {
        let p = page as usize;
        (self.generation[p], self.owner[p], self.filled[0][p])
    }

    /// Fault injection (tests only, named as such): overwrite a page's tag fields as a buggy or
    /// malicious component could, to prove that the read-side check catches it.
    pub fn fault_inject_set_tag(&mut self, page: u32, generation: u32, owner: u64) {
        self.generation[page as usize] = generation;
        self.owner[page as usize] = owner;
    }
}

/// A zeroed f16 vector through the zero-allocation fast path (`calloc`: pages are mapped lazily,
/// so a large pool costs nothing until used). `vec![f16::ZERO; n]` would memset eagerly.
fn zeroed_f16(n: usize) -> Vec<f16> {
    let mut v = std::mem::ManuallyDrop::new(vec![0u16; n]);
    // SAFETY: `half::f16` is `#[repr(transparent)]` over `u16` (same size and alignment, every bit
    // pattern valid), so the allocation can be reinterpreted; ownership moves to the new Vec.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<f16>(), v.len(), v.capacity()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: PageGeometry = PageGeometry {
        page_size: 4,
        n_kv_heads: 1,
        head_dim: 2,
    };

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
        assert_eq!(pool.tag(a[0].page), (a[0].generation, 7, 1));
    }
}
