//! The transport's probe ABI: C-layout work requests and completions that mirror libibverbs'
//! `ibv_sge`, `ibv_send_wr` and `ibv_wc` (x86-64 layouts, checked by the assertions below), and
//! the `#[no_mangle]` probe-point functions every transport calls.
//!
//! This is the contract with the eBPF witness (`ebpf/`): one decoder reads the work requests of
//! the `tcp` transport and of real verbs. It is a crate of its own with no dependencies, which
//! the transports and the witness's tests both compile against: a change here is a change to
//! both, caught by the build and by the witness's tests, not by a witness in production. Field offsets (bytes):
//!
//! | struct      | field        | offset | size |
//! |-------------|--------------|--------|------|
//! | `Sge`       | addr         | 0      | 8    |
//! |             | length       | 8      | 4    |
//! |             | lkey         | 12     | 4    |
//! | `SendWr`    | wr_id        | 0      | 8    |
//! |             | next         | 8      | 8    |
//! |             | sg_list      | 16     | 8    |
//! |             | num_sge      | 24     | 4    |
//! |             | opcode       | 28     | 4    |
//! |             | send_flags   | 32     | 4    |
//! |             | imm_data     | 36     | 4 (network byte order, as `__be32`) |
//! |             | remote_addr  | 40     | 8    |
//! |             | rkey         | 48     | 4    |
//! |             | (size)       | 128    |      |
//! | `Wc`        | wr_id        | 0      | 8    |
//! |             | status       | 8      | 4    |
//! |             | opcode       | 12     | 4    |
//! |             | byte_len     | 20     | 4    |
//! |             | imm_data     | 24     | 4 (network byte order) |
//! |             | qp_num       | 28     | 4    |
//! |             | (size)       | 48     |      |
//!
//! # Probe points
//! Each is `extern "C"`, `#[no_mangle]`, never inlined, exported in the dynamic symbol table (the
//! binary links with `--export-dynamic-symbol=custody_kv_*`), and on x86-64 its first instruction
//! is a 5-byte `nop` (a naked trampoline that jumps to the implementation): a uprobe on such an
//! instruction is emulated cheaply (~0.7 µs a hit measured here) instead of single-stepping a
//! Rust prologue (~13 µs).
//!
//! | symbol                   | arguments (System V: rdi, rsi, rdx, rcx)            |
//! |--------------------------|-----------------------------------------------------|
//! | `custody_kv_post_write`  | `ctx: u64`, `wr: *const SendWr` (a `next` chain)    |
//! | `custody_kv_complete`    | `ctx: u64`, `wcs: *const Wc`, `n: u32` (a batch, as one poll of a completion queue returns it; `n` ≤ [`COMPLETE_BATCH_MAX`]) |
//! | `custody_kv_register`    | `ctx: u64`, `rkey: u32`, `addr: u64`, `len: u64`    |
//! | `custody_kv_invalidate`  | `ctx: u64`, `rkey: u32`                             |
//!
//! `ctx` identifies the transport instance: `(node_id << 32) | instance`.
// Every result in runtime/ is handled or dropped with its reason (`Discard`), never `let _ =`.
#![deny(clippy::let_underscore_must_use)]

use std::sync::atomic::{AtomicU32, Ordering};

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `IBV_WR_RDMA_WRITE`.
pub const WR_RDMA_WRITE: u32 = 0;
/// `IBV_WR_RDMA_WRITE_WITH_IMM`.
pub const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
/// `IBV_SEND_SIGNALED`.
pub const SEND_SIGNALED: u32 = 1 << 1;

/// `struct ibv_send_wr` (only the RDMA-write members are used; the rest is reserved, zero).
#[repr(C)]
#[derive(Debug)]
pub struct SendWr {
    pub wr_id: u64,
    pub next: *const SendWr,
    pub sg_list: *const Sge,
    pub num_sge: i32,
    pub opcode: u32,
    pub send_flags: u32,
    /// Immediate data in network byte order (`__be32`).
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    reserved: [u32; 19],
}

impl SendWr {
    pub fn rdma_write(wr_id: u64, sges: &[Sge], remote_addr: u64, rkey: u32) -> Self {
        Self {
            wr_id,
            next: std::ptr::null(),
            sg_list: sges.as_ptr(),
            num_sge: i32::try_from(sges.len()).unwrap_or(i32::MAX),
            opcode: WR_RDMA_WRITE,
            send_flags: 0,
            imm_data: 0,
            remote_addr,
            rkey,
            reserved: [0; 19],
        }
    }

    /// The last write of a page: signaled, with immediate data (host order in, stored big-endian).
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.opcode = WR_RDMA_WRITE_WITH_IMM;
        self.send_flags |= SEND_SIGNALED;
        self.imm_data = imm.to_be();
        self
    }
}

/// `enum ibv_wc_status` values used here.
pub mod wc_status {
    pub const SUCCESS: u32 = 0;
    pub const LOC_LEN_ERR: u32 = 1;
    pub const WR_FLUSH_ERR: u32 = 5;
    pub const REM_INV_REQ_ERR: u32 = 9;
    pub const REM_ACCESS_ERR: u32 = 10;
    pub const RETRY_EXC_ERR: u32 = 12;
}

/// `enum ibv_wc_opcode` values used here.
pub mod wc_opcode {
    pub const RDMA_WRITE: u32 = 1;
    pub const RECV_RDMA_WITH_IMM: u32 = 129;
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
    reserved: [u8; 2],
}

impl Wc {
    pub fn new(wr_id: u64, status: u32, opcode: u32, byte_len: u32, imm_host: u32) -> Self {
        Self {
            wr_id,
            status,
            opcode,
            byte_len,
            imm_data: imm_host.to_be(),
            wc_flags: u32::from(opcode == wc_opcode::RECV_RDMA_WITH_IMM) * 2, // IBV_WC_WITH_IMM
            ..Self::default()
        }
    }
    pub fn imm(&self) -> u32 {
        u32::from_be(self.imm_data)
    }
    pub fn ok(&self) -> bool {
        self.status == wc_status::SUCCESS
    }
}

const _: () = {
    assert!(std::mem::size_of::<Sge>() == 16);
    assert!(std::mem::size_of::<SendWr>() == 128);
    assert!(std::mem::offset_of!(SendWr, sg_list) == 16);
    assert!(std::mem::offset_of!(SendWr, num_sge) == 24);
    assert!(std::mem::offset_of!(SendWr, imm_data) == 36);
    assert!(std::mem::offset_of!(SendWr, remote_addr) == 40);
    assert!(std::mem::offset_of!(SendWr, rkey) == 48);
    assert!(std::mem::size_of::<Wc>() == 48);
    assert!(std::mem::offset_of!(Wc, byte_len) == 20);
    assert!(std::mem::offset_of!(Wc, imm_data) == 24);
};

static NEXT_INSTANCE: AtomicU32 = AtomicU32::new(1);

/// A fresh probe context for a transport instance of `node`.
pub fn new_ctx(node: u32) -> u64 {
    (u64::from(node) << 32) | u64::from(NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed))
}

// ---- probe points -------------------------------------------------------------------------------
//
// The implementations are deliberately trivial: the probe point is where the transport *announces*
// what it puts on the wire or learns from it, with the exact structures; the transport itself does
// the work right after (or before, for completions). Keeping them separate from the transport's
// code means a probe point never changes meaning when the transport's internals change.

#[inline(never)]
extern "C" fn post_write_impl(ctx: u64, wr: *const SendWr) -> i32 {
    std::hint::black_box((ctx, wr));
    0
}
#[inline(never)]
extern "C" fn complete_impl(ctx: u64, wcs: *const Wc, n: u32) -> i32 {
    std::hint::black_box((ctx, wcs, n));
    0
}
#[inline(never)]
extern "C" fn register_impl(ctx: u64, rkey: u32, addr: u64, len: u64) -> i32 {
    std::hint::black_box((ctx, rkey, addr, len));
    0
}
#[inline(never)]
extern "C" fn invalidate_impl(ctx: u64, rkey: u32) -> i32 {
    std::hint::black_box((ctx, rkey));
    0
}

/// Defines a probe point: on x86-64 a naked trampoline whose first instruction is the 5-byte
/// `nopl 0x0(%rax,%rax,1)` followed by a tail jump to the implementation.
macro_rules! probe_point {
    ($(#[$m:meta])* $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* )) => {
        $(#[$m])*
        #[cfg(target_arch = "x86_64")]
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($arg: $ty),*) -> i32 {
            core::arch::naked_asm!(
                ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
                "jmp {imp}",
                imp = sym $imp,
            )
        }
        $(#[$m])*
        #[cfg(not(target_arch = "x86_64"))]
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $name($($arg: $ty),*) -> i32 {
            $imp($($arg),*)
        }
    };
}

probe_point!(
    /// Announces a chain of work requests about to be put on the wire.
    custody_kv_post_write => post_write_impl(ctx: u64, wr: *const SendWr)
);
probe_point!(
    /// Announces a batch of completions (send side: signaled writes acknowledged or failed;
    /// receive side: writes with immediate data landed), `n` ≤ [`COMPLETE_BATCH_MAX`]. Use
    /// [`announce_completions`].
    custody_kv_complete => complete_impl(ctx: u64, wcs: *const Wc, n: u32)
);

/// The most completions one `custody_kv_complete` call announces: the witness decodes at most
/// this many per call (its BPF loop bound, MAX_WC_BATCH) and counts any excess as lost.
pub const COMPLETE_BATCH_MAX: usize = 256;

/// Announce `wcs` through the `custody_kv_complete` probe point, in batches of at most
/// [`COMPLETE_BATCH_MAX`] — one probe hit per batch, not per completion (a hit costs the posting
/// or polling thread ~0.5 µs here; a completion within a batch a fraction of that).
pub fn announce_completions(ctx: u64, wcs: &[Wc]) {
    for batch in wcs.chunks(COMPLETE_BATCH_MAX) {
        debug_assert!(!batch.is_empty() && batch.len() <= COMPLETE_BATCH_MAX);
        // `batch.len()` ≤ COMPLETE_BATCH_MAX fits in u32.
        custody_kv_complete(ctx, batch.as_ptr(), batch.len() as u32);
    }
}
probe_point!(
    /// Announces a registered region: writes with `rkey` to `addr..addr + len` may land.
    custody_kv_register => register_impl(ctx: u64, rkey: u32, addr: u64, len: u64)
);
probe_point!(
    /// Announces an invalidated key: no write with it lands after this.
    custody_kv_invalidate => invalidate_impl(ctx: u64, rkey: u32)
);

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn probe_points_start_with_a_five_byte_nop() {
        for f in [
            custody_kv_post_write as *const u8,
            custody_kv_complete as *const u8,
            custody_kv_register as *const u8,
            custody_kv_invalidate as *const u8,
        ] {
            // SAFETY: reading the first 5 bytes of a function's machine code (mapped r-x).
            let head = unsafe { std::slice::from_raw_parts(f, 5) };
            assert_eq!(head, [0x0f, 0x1f, 0x44, 0x00, 0x00]);
        }
        assert_eq!(custody_kv_register(1, 2, 3, 4), 0);
    }
}
