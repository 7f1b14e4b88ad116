//! The ring buffer's record (`struct event` in `bpf/witness.bpf.c`), decoded without `unsafe`
//! from its little-endian bytes, and its audit row.

use custody_audit::{Event, RdmaMr, RdmaOp};

/// Scatter/gather entries a record carries (`MAX_SGE` in the C program).
pub const MAX_SGE: usize = 30;
/// Bytes before the scatter/gather entries (what non-write records carry).
pub const HEAD_BYTES: usize = 96;
/// A whole work-request record.
pub const EVENT_BYTES: usize = HEAD_BYTES + MAX_SGE * 16;

/// What was observed (`enum kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    PostWrite,
    Complete,
    Register,
    Invalidate,
    IbvRegMr,
    IbvDeregMr,
    IbvCreateQp,
    IbvModifyQp,
    IbvDestroyQp,
}

impl Kind {
    fn from_raw(k: u32) -> Option<Self> {
        Some(match k {
            1 => Kind::PostWrite,
            2 => Kind::Complete,
            3 => Kind::Register,
            4 => Kind::Invalidate,
            5 => Kind::IbvRegMr,
            6 => Kind::IbvDeregMr,
            7 => Kind::IbvCreateQp,
            8 => Kind::IbvModifyQp,
            9 => Kind::IbvDestroyQp,
            _ => return None,
        })
    }

    /// The `op` column.
    pub fn name(self) -> &'static str {
        match self {
            Kind::PostWrite => "post_write",
            Kind::Complete => "complete",
            Kind::Register => "register",
            Kind::Invalidate => "invalidate",
            Kind::IbvRegMr => "ibv_reg_mr",
            Kind::IbvDeregMr => "ibv_dereg_mr",
            Kind::IbvCreateQp => "create_qp",
            Kind::IbvModifyQp => "modify_qp",
            Kind::IbvDestroyQp => "destroy_qp",
        }
    }

    /// Registrations go to `rdma_mr`, everything else to `rdma_ops`.
    pub fn is_registration(self) -> bool {
        matches!(
            self,
            Kind::Register | Kind::Invalidate | Kind::IbvRegMr | Kind::IbvDeregMr
        )
    }
}

/// A decoded scatter/gather entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// One decoded record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    pub ktime_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub kind: Kind,
    pub flags: u32,
    pub ctx: u64,
    pub wr_id: u64,
    pub addr: u64,
    pub bytes: u64,
    pub rkey: u32,
    pub lkey: u32,
    pub opcode: u32,
    pub send_flags: u32,
    /// Immediate data as in memory (network byte order).
    pub imm_be: u32,
    pub status: i32,
    pub num_sge: u32,
    pub chain_index: u32,
    pub qp_num: u32,
    pub cpu: u32,
    pub sges: Vec<Sge>,
}

/// Record flags (`F_*`).
pub const F_READ_FAULT: u32 = 1;
pub const F_SGE_TRUNCATED: u32 = 2;
pub const F_NO_ENTRY: u32 = 4;

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(a)
}

/// Why a record could not be decoded (counted by the collector, never ignored).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its {1}-byte header")]
    Short(usize, usize),
    #[error("unknown record kind {0}")]
    Kind(u32),
}

impl Observation {
    /// Decode one ring-buffer record.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < HEAD_BYTES {
            return Err(DecodeError::Short(b.len(), HEAD_BYTES));
        }
        let kind = Kind::from_raw(u32_at(b, 16)).ok_or(DecodeError::Kind(u32_at(b, 16)))?;
        let num_sge = u32_at(b, 80);
        let mut sges = Vec::new();
        // A write's record carries its SGEs only when configured (`record_sges`).
        if kind == Kind::PostWrite && b.len() >= EVENT_BYTES {
            let n = (num_sge as usize).min(MAX_SGE);
            sges.extend((0..n).map(|i| {
                let o = HEAD_BYTES + i * 16;
                Sge {
                    addr: u64_at(b, o),
                    length: u32_at(b, o + 8),
                    lkey: u32_at(b, o + 12),
                }
            }));
        }
        Ok(Self {
            ktime_ns: u64_at(b, 0),
            pid: u32_at(b, 8),
            tid: u32_at(b, 12),
            kind,
            flags: u32_at(b, 20),
            ctx: u64_at(b, 24),
            wr_id: u64_at(b, 32),
            addr: u64_at(b, 40),
            bytes: u64_at(b, 48),
            rkey: u32_at(b, 56),
            lkey: u32_at(b, 60),
            opcode: u32_at(b, 64),
            send_flags: u32_at(b, 68),
            imm_be: u32_at(b, 72),
            status: u32_at(b, 76) as i32,
            num_sge,
            chain_index: u32_at(b, 84),
            qp_num: u32_at(b, 88),
            cpu: u32_at(b, 92),
            sges,
        })
    }

    fn probe_flags(&self) -> Option<String> {
        let names: Vec<&str> = [
            (F_READ_FAULT, "read_fault"),
            (F_SGE_TRUNCATED, "sge_truncated"),
            (F_NO_ENTRY, "no_entry"),
        ]
        .iter()
        .filter(|(f, _)| self.flags & f != 0)
        .map(|&(_, n)| n)
        .collect();
        (!names.is_empty()).then(|| names.join(","))
    }

    /// The audit row (`rdma_ops` or `rdma_mr`); `ts_ns` is on the collector's audit clock.
    pub fn to_event(&self, ts_ns: u64) -> Event {
        if self.kind.is_registration() {
            return Event::RdmaMr(Box::new(RdmaMr {
                ts_ns,
                ktime_ns: self.ktime_ns,
                pid: self.pid,
                tid: self.tid,
                op: self.kind.name(),
                ctx: self.ctx,
                addr: self.addr,
                len: self.bytes,
                lkey: self.lkey,
                rkey: self.rkey,
                access: self.send_flags,
                status: self.status,
                probe_flags: self.probe_flags(),
            }));
        }
        let sges = (self.kind == Kind::PostWrite && !self.sges.is_empty()).then(|| {
            self.sges
                .iter()
                .map(|s| format!("{:#x}:{}:{}", s.addr, s.length, s.lkey))
                .collect::<Vec<_>>()
                .join(" ")
        });
        Event::RdmaOp(Box::new(RdmaOp {
            ts_ns,
            ktime_ns: self.ktime_ns,
            pid: self.pid,
            tid: self.tid,
            op: self.kind.name(),
            ctx: self.ctx,
            wr_id: self.wr_id,
            chain_index: self.chain_index,
            opcode: self.opcode,
            flags: self.send_flags,
            imm: u32::from_be(self.imm_be),
            remote_addr: self.addr,
            rkey: self.rkey,
            num_sge: self.num_sge,
            bytes: self.bytes,
            status: self.status,
            qp_num: self.qp_num,
            sges,
            probe_flags: self.probe_flags(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u32) -> Vec<u8> {
        let mut b = vec![0u8; EVENT_BYTES];
        b[0..8].copy_from_slice(&123u64.to_le_bytes());
        b[8..12].copy_from_slice(&7u32.to_le_bytes());
        b[16..20].copy_from_slice(&kind.to_le_bytes());
        b[32..40].copy_from_slice(&0xabcdu64.to_le_bytes());
        b[40..48].copy_from_slice(&0x1000u64.to_le_bytes());
        b[56..60].copy_from_slice(&9u32.to_le_bytes());
        b[72..76].copy_from_slice(&5u32.to_be().to_le_bytes());
        b[76..80].copy_from_slice(&(-1i32).to_le_bytes());
        b[80..84].copy_from_slice(&2u32.to_le_bytes()); // num_sge
        b[84..88].copy_from_slice(&3u32.to_le_bytes()); // chain index
        b[88..92].copy_from_slice(&11u32.to_le_bytes()); // qp
        for i in 0..2 {
            let o = HEAD_BYTES + i * 16;
            b[o..o + 8].copy_from_slice(&(0x100 * (i as u64 + 1)).to_le_bytes());
            b[o + 8..o + 12].copy_from_slice(&64u32.to_le_bytes());
        }
        b
    }

    #[test]
    fn decodes_a_work_request() {
        let o = Observation::decode(&record(1)).expect("decode");
        assert_eq!(o.kind, Kind::PostWrite);
        assert_eq!(
            (o.ktime_ns, o.pid, o.wr_id, o.addr, o.rkey),
            (123, 7, 0xabcd, 0x1000, 9)
        );
        assert_eq!(
            (o.num_sge, o.chain_index, o.qp_num, o.status),
            (2, 3, 11, -1)
        );
        assert_eq!(o.sges.len(), 2);
        assert_eq!(o.sges[1].addr, 0x200);
        let Event::RdmaOp(op) = o.to_event(5) else {
            panic!("a write is an rdma_ops row")
        };
        assert_eq!(op.imm, 5);
        assert_eq!(op.sges.as_deref(), Some("0x100:64:0 0x200:64:0"));
    }

    #[test]
    fn refuses_short_and_unknown_records() {
        assert_eq!(
            Observation::decode(&[0u8; 10]),
            Err(DecodeError::Short(10, HEAD_BYTES))
        );
        let o = Observation::decode(&record(1)[..HEAD_BYTES]).expect("a write without SGEs");
        assert!(o.sges.is_empty());
        assert_eq!(o.num_sge, 2);
        assert_eq!(Observation::decode(&record(42)), Err(DecodeError::Kind(42)));
        let o = Observation::decode(&record(3)[..HEAD_BYTES]).expect("a header-only record");
        assert!(matches!(o.to_event(0), Event::RdmaMr(_)));
    }
}
