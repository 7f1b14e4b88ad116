//! The ring buffer's record (`struct event` in `bpf/witness.bpf.c`), decoded without `unsafe`
//! from its little-endian bytes, and its audit row.

use custody_audit::{Event, RdmaMr, RdmaOp};

/// Scatter/gather entries a record carries (`MAX_SGE` in the C program).
pub const MAX_SGE: usize = 30;
/// Bytes before the scatter/gather entries (what non-write records carry).
pub const HEAD_BYTES: usize = 96;
/// A whole work-request record.
pub const EVENT_BYTES: usize = HEAD_BYTES + MAX_SGE * 16;
/// `EV_POST_BATCH`: a header and up to [`POST_BATCH_WRS`] work-request entries (`struct
/// wr_entry`, [`WR_ENTRY_BYTES`] each) of one post — the default record of a posted chain (without
/// SGE lists). The header's `chain_index` is the first entry's position in its chain and its
/// `num_sge` the number of entries.
pub const KIND_POST_BATCH: u32 = 10;
pub const POST_BATCH_WRS: usize = 8;
pub const WR_ENTRY_BYTES: usize = 48;

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
    #[error("batch record of {0} entries (at most {POST_BATCH_WRS})")]
    Entries(usize),
}

impl Observation {
    /// Every observation in one ring-buffer record, in order: one, or a batch record's entries
    /// (each a [`Kind::PostWrite`] with the post's header fields). Returns how many.
    pub fn decode_all(b: &[u8], mut f: impl FnMut(Observation)) -> Result<usize, DecodeError> {
        if b.len() < HEAD_BYTES {
            return Err(DecodeError::Short(b.len(), HEAD_BYTES));
        }
        if u32_at(b, 16) != KIND_POST_BATCH {
            f(Self::decode(b)?);
            return Ok(1);
        }
        let n = u32_at(b, 80) as usize;
        if n > POST_BATCH_WRS {
            return Err(DecodeError::Entries(n));
        }
        let need = HEAD_BYTES + n * WR_ENTRY_BYTES;
        if b.len() < need {
            return Err(DecodeError::Short(b.len(), need));
        }
        let first = u32_at(b, 84);
        for i in 0..n {
            let o = HEAD_BYTES + i * WR_ENTRY_BYTES;
            f(Observation {
                ktime_ns: u64_at(b, 0),
                pid: u32_at(b, 8),
                tid: u32_at(b, 12),
                kind: Kind::PostWrite,
                flags: u32_at(b, o + 44),
                ctx: u64_at(b, 24),
                wr_id: u64_at(b, o),
                addr: u64_at(b, o + 8),
                bytes: u64_at(b, o + 16),
                rkey: u32_at(b, o + 24),
                lkey: 0,
                opcode: u32_at(b, o + 28),
                send_flags: u32_at(b, o + 32),
                imm_be: u32_at(b, o + 36),
                status: 0,
                num_sge: u32_at(b, o + 40),
                chain_index: first + i as u32,
                qp_num: 0,
                cpu: u32_at(b, 92),
                sges: Vec::new(),
            });
        }
        Ok(n)
    }

    /// Decode one ring-buffer record (not a batch record: see [`Observation::decode_all`]).
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
        Event::RdmaOp(Box::new(self.to_rdma_op(ts_ns)))
    }

    /// An operation (not a registration: see [`Kind::is_registration`]) as its `rdma_ops` row.
    pub fn to_rdma_op(&self, ts_ns: u64) -> RdmaOp {
        debug_assert!(!self.kind.is_registration());
        let sges = (self.kind == Kind::PostWrite && !self.sges.is_empty()).then(|| {
            self.sges
                .iter()
                .map(|s| format!("{:#x}:{}:{}", s.addr, s.length, s.lkey))
                .collect::<Vec<_>>()
                .join(" ")
        });
        RdmaOp {
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
        }
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

    fn batch(n: u32, entries: usize) -> Vec<u8> {
        let mut b = vec![0u8; HEAD_BYTES + entries * WR_ENTRY_BYTES];
        b[0..8].copy_from_slice(&555u64.to_le_bytes());
        b[8..12].copy_from_slice(&7u32.to_le_bytes());
        b[12..16].copy_from_slice(&8u32.to_le_bytes());
        b[16..20].copy_from_slice(&KIND_POST_BATCH.to_le_bytes());
        b[24..32].copy_from_slice(&99u64.to_le_bytes());
        b[80..84].copy_from_slice(&n.to_le_bytes());
        b[84..88].copy_from_slice(&16u32.to_le_bytes()); // first entry's chain index
        b[92..96].copy_from_slice(&1u32.to_le_bytes());
        for i in 0..entries {
            let o = HEAD_BYTES + i * WR_ENTRY_BYTES;
            b[o..o + 8].copy_from_slice(&(0x700 + i as u64).to_le_bytes());
            b[o + 8..o + 16].copy_from_slice(&(0x1000 * i as u64).to_le_bytes());
            b[o + 16..o + 24].copy_from_slice(&(64 * i as u64).to_le_bytes());
            b[o + 24..o + 28].copy_from_slice(&5u32.to_le_bytes());
            b[o + 28..o + 32].copy_from_slice(&1u32.to_le_bytes());
            b[o + 32..o + 36].copy_from_slice(&2u32.to_le_bytes());
            b[o + 36..o + 40].copy_from_slice(&(40 + i as u32).to_be().to_le_bytes());
            b[o + 40..o + 44].copy_from_slice(&3u32.to_le_bytes());
            b[o + 44..o + 48].copy_from_slice(&(i as u32 % 2).to_le_bytes());
        }
        b
    }

    #[test]
    fn decodes_a_batch_record_entry_by_entry() {
        let mut got = Vec::new();
        let n = Observation::decode_all(&batch(3, 3), |o| got.push(o)).expect("decode");
        assert_eq!((n, got.len()), (3, 3));
        for (i, o) in got.iter().enumerate() {
            assert_eq!(o.kind, Kind::PostWrite);
            assert_eq!((o.ktime_ns, o.pid, o.tid, o.ctx, o.cpu), (555, 7, 8, 99, 1));
            assert_eq!(o.chain_index, 16 + i as u32);
            assert_eq!(
                (o.wr_id, o.addr, o.bytes),
                (0x700 + i as u64, 0x1000 * i as u64, 64 * i as u64)
            );
            assert_eq!((o.rkey, o.opcode, o.send_flags, o.num_sge), (5, 1, 2, 3));
            assert_eq!(
                (u32::from_be(o.imm_be), o.flags),
                (40 + i as u32, i as u32 % 2)
            );
        }
        let row = got[1].to_rdma_op(10);
        assert_eq!(
            (row.op, row.imm, row.probe_flags.as_deref()),
            ("post_write", 41, Some("read_fault"))
        );
        // A single record decodes as one.
        let mut one = 0;
        assert_eq!(Observation::decode_all(&record(2), |_| one += 1), Ok(1));
        assert_eq!(one, 1);
    }

    #[test]
    fn a_malformed_batch_record_is_an_error_not_a_guess() {
        let short = batch(3, 2);
        assert_eq!(
            Observation::decode_all(&short, |_| panic!("nothing decoded")),
            Err(DecodeError::Short(
                short.len(),
                HEAD_BYTES + 3 * WR_ENTRY_BYTES
            ))
        );
        assert_eq!(
            Observation::decode_all(&batch(9, 9), |_| panic!("nothing decoded")),
            Err(DecodeError::Entries(9))
        );
    }
}
