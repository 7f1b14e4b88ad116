//! [`Pinned`]: page-locked host memory the CUDA device stages uploads in, so that a step's
//! inputs go to the device as asynchronous DMA copies (`cuMemcpyHtoDAsync` from pinned memory
//! returns at once; from pageable memory it is staged by the driver and, in effect, waits).
//!
//! A bump region: each upload takes the next bytes, and the whole region is free again once the
//! stream has been waited for (every copy that read it has finished). An upload that does not fit
//! waits for the stream first; one larger than the region grows it (after the wait), by doubling,
//! up to what it needs.

use std::ffi::c_void;

use cudarc::driver::result;

use crate::device::DeviceError;

/// The region's first size: a decode step's inputs, tables and tag changes fit many times over.
pub const FIRST_BYTES: usize = 4 << 20;

/// Page-locked host memory, bump-allocated between waits.
pub struct Pinned {
    base: *mut u8,
    bytes: usize,
    used: usize,
}

fn driver(e: impl std::fmt::Display) -> DeviceError {
    DeviceError::Driver(format!("pinned host memory: {e}"))
}

impl Pinned {
    /// [`FIRST_BYTES`] of pinned memory (the context must be current).
    pub fn new() -> Result<Self, DeviceError> {
        Ok(Self {
            base: alloc(FIRST_BYTES)?,
            bytes: FIRST_BYTES,
            used: 0,
        })
    }

    /// Whether `len` more bytes fit before the next wait.
    pub fn fits(&self, len: usize) -> bool {
        self.used + len <= self.bytes
    }

    /// Every copy from the region has finished (the caller waited for the stream): reuse it,
    /// grown first to hold `len` bytes if it is smaller.
    pub fn reset(&mut self, len: usize) -> Result<(), DeviceError> {
        self.used = 0;
        if len <= self.bytes {
            return Ok(());
        }
        let bytes = len.next_power_of_two();
        let grown = alloc(bytes)?;
        // SAFETY: `base` came from `alloc` and no copy reads it any more (the caller waited).
        unsafe { result::free_host(self.base.cast::<c_void>()) }.map_err(driver)?;
        self.base = grown;
        self.bytes = bytes;
        Ok(())
    }

    /// `len` bytes of the region for a copy from the device to land in (`take`'s pointer),
    /// valid until the next [`Self::reset`]. The caller checked [`Self::fits`].
    pub fn take(&mut self, len: usize) -> *mut u8 {
        assert!(self.fits(len), "taken past the pinned region");
        // SAFETY: `[used, used + len)` lies inside the allocation (checked above) and is not
        // handed out twice before a reset.
        let at = unsafe { self.base.add(self.used) };
        self.used += len.next_multiple_of(16);
        at
    }

    /// `src` copied into the region: the pinned copy, valid until the next [`Self::reset`].
    /// The caller checked [`Self::fits`].
    pub fn stage(&mut self, src: &[u8]) -> &[u8] {
        assert!(self.fits(src.len()), "staged past the pinned region");
        // SAFETY: `[used, used + len)` lies inside the allocation (checked above) and is not
        // handed out twice before a reset; `src` is host memory of its own.
        let dst = unsafe {
            let dst = self.base.add(self.used);
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
            std::slice::from_raw_parts(dst, src.len())
        };
        // 16-byte steps keep each staged copy aligned for the DMA engine.
        self.used += src.len().next_multiple_of(16);
        dst
    }
}

fn alloc(bytes: usize) -> Result<*mut u8, DeviceError> {
    // SAFETY: a plain page-locked allocation (flags 0), freed in `Pinned::reset` or `Drop`.
    let p = unsafe { result::malloc_host(bytes, 0) }.map_err(driver)?;
    Ok(p.cast::<u8>())
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc`; the device waits for its stream before dropping
        // this (its `Drop` synchronizes first).
        let freed = unsafe { result::free_host(self.base.cast::<c_void>()) };
        debug_assert!(freed.is_ok(), "freeing pinned memory failed: {freed:?}");
    }
}
