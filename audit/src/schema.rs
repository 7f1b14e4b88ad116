//! Arrow schemas of the audit tables and the column builders that turn [`Event`]s into record
//! batches. Field-by-field documentation: `docs/audit-schema.md` (keep the two in step).
//!
//! Every table starts with the same four columns:
//! `node_id` (u32; also the Hive partition `node=`), `seq` (u64: per-node sequence number over *all* tables, gap-free by construction,
//! so a missing row is visible), `ts_ns` (u64: node monotonic clock) and `wall_ns` (i64: Unix-epoch
//! nanoseconds = the writer's wall-clock anchor + (`ts_ns` − monotonic anchor)).

use std::sync::Arc;

use arrow::array::{
    ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray, StringBuilder, UInt32Array,
    UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::{Event, PageKind, RdmaOpRows, Writer};

/// Version of the table layouts, written into every file's metadata.
pub const SCHEMA_VERSION: &str = "7";
pub const SCHEMA_VERSION_KEY: &str = "custody.audit.schema_version";

/// The audit tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Requests,
    PageEvents,
    Transfers,
    PageReads,
    IntegrityViolations,
    /// The writer's own records (e.g. dropped-event counts in `allow_drop` mode).
    WriterEvents,
    /// Node lifecycle and configuration facts (start, role, unsafe reproduction switches).
    NodeEvents,
    /// The eBPF witness's observations of the transfer path (work requests, completions, QPs).
    RdmaOps,
    /// The eBPF witness's observations of memory registration.
    RdmaMr,
    /// Prefix-cache shares, hits and evictions.
    PrefixCache,
    /// Per request: its output constraint, log-probabilities, biases and penalties.
    RequestDecoding,
    /// Per request with tools: the functions offered, the choice, the functions called.
    RequestTools,
    /// KV offload: pages stored in a tier, restored, evicted from their last tier.
    KvOffload,
}

impl Table {
    pub const ALL: [Table; 13] = [
        Table::Requests,
        Table::PageEvents,
        Table::Transfers,
        Table::PageReads,
        Table::IntegrityViolations,
        Table::WriterEvents,
        Table::NodeEvents,
        Table::RdmaOps,
        Table::RdmaMr,
        Table::PrefixCache,
        Table::RequestDecoding,
        Table::RequestTools,
        Table::KvOffload,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Table::Requests => "requests",
            Table::PageEvents => "page_events",
            Table::Transfers => "transfers",
            Table::PageReads => "page_reads",
            Table::IntegrityViolations => "integrity_violations",
            Table::WriterEvents => "writer_events",
            Table::NodeEvents => "node_events",
            Table::RdmaOps => "rdma_ops",
            Table::RdmaMr => "rdma_mr",
            Table::PrefixCache => "prefix_cache",
            Table::RequestDecoding => "request_decoding",
            Table::RequestTools => "request_tools",
            Table::KvOffload => "kv_offload",
        }
    }

    pub fn from_name(s: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.name() == s)
    }

    pub fn of(ev: &Event) -> Table {
        match ev {
            Event::Request { .. } => Table::Requests,
            Event::Page { .. } => Table::PageEvents,
            Event::Transfer { .. } => Table::Transfers,
            Event::Read { .. } => Table::PageReads,
            Event::IntegrityViolation { .. } => Table::IntegrityViolations,
            Event::Node { .. } => Table::NodeEvents,
            Event::RdmaOp(_) => Table::RdmaOps,
            Event::RdmaMr(_) => Table::RdmaMr,
            Event::Cache(_) => Table::PrefixCache,
            Event::Decoding(_) => Table::RequestDecoding,
            Event::Tools(_) => Table::RequestTools,
            Event::Offload(_) => Table::KvOffload,
        }
    }

    /// Columns after the four common ones.
    fn columns(self) -> Vec<(&'static str, DataType, bool)> {
        use DataType::{Int32, UInt32, UInt64, Utf8};
        match self {
            Table::Requests => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("event", Utf8, false),
                ("reason", Utf8, true),
                ("prompt_tokens", UInt32, false),
                ("output_tokens", UInt32, false),
            ],
            Table::PageEvents => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("event", Utf8, false),
                ("page", UInt32, false),
                ("generation", UInt32, false),
                ("slot_start", UInt32, true),
                ("slot_end", UInt32, true),
                ("writer", Utf8, true),
            ],
            Table::Transfers => vec![
                ("transfer_id", UInt64, false),
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("src_node", UInt32, false),
                ("src_page", UInt32, false),
                ("src_generation", UInt32, false),
                ("dst_node", UInt32, false),
                ("dst_page", UInt32, false),
                ("dst_generation", UInt32, false),
                ("bytes", UInt64, false),
                ("checksum", UInt64, false),
                ("outcome", Utf8, false),
                ("rkey", UInt32, false),
                ("remote_addr", UInt64, false),
                ("remote_len", UInt64, false),
                ("wire_bytes", UInt64, false),
                ("work_requests", UInt32, false),
            ],
            Table::PageReads => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("page", UInt32, false),
                ("generation", UInt32, false),
                ("slot_start", UInt32, false),
                ("slot_end", UInt32, false),
                ("first_step", UInt32, false),
                ("last_step", UInt32, false),
                ("verdict", Utf8, false),
            ],
            Table::IntegrityViolations => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("page", UInt32, true),
                ("generation", UInt32, true),
                ("kind", Utf8, false),
                ("detail", Utf8, false),
            ],
            Table::WriterEvents => vec![("event", Utf8, false), ("count", UInt64, false)],
            Table::NodeEvents => vec![("event", Utf8, false), ("detail", Utf8, false)],
            Table::RdmaOps => vec![
                ("ktime_ns", UInt64, false),
                ("pid", UInt32, false),
                ("tid", UInt32, false),
                ("op", Utf8, false),
                ("ctx", UInt64, false),
                ("wr_id", UInt64, false),
                ("chain_index", UInt32, false),
                ("opcode", UInt32, false),
                ("flags", UInt32, false),
                ("imm", UInt32, false),
                ("remote_addr", UInt64, false),
                ("rkey", UInt32, false),
                ("num_sge", UInt32, false),
                ("bytes", UInt64, false),
                ("status", Int32, false),
                ("qp_num", UInt32, false),
                ("sges", Utf8, true),
                ("probe_flags", Utf8, true),
            ],
            Table::RequestDecoding => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("constraint_kind", Utf8, true),
                ("constraint_sha256", Utf8, true),
                ("n", UInt32, false),
                ("top_logprobs", UInt32, true),
                ("logit_bias_tokens", UInt32, false),
                ("presence_penalty_milli", Int32, false),
                ("frequency_penalty_milli", Int32, false),
            ],
            Table::RequestTools => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("format", Utf8, false),
                ("tool_choice", Utf8, false),
                ("offered", Utf8, false),
                ("called", Utf8, false),
                ("calls", UInt32, false),
            ],
            Table::KvOffload => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("event", Utf8, false),
                ("tier", Utf8, false),
                ("page", UInt32, true),
                ("generation", UInt32, true),
                ("key", Utf8, false),
                ("namespace", Utf8, true),
                ("scope", Utf8, true),
                ("writer_node", UInt32, true),
                ("writer_request_id", UInt64, true),
                ("writer_tenant", Utf8, true),
                ("bytes", UInt64, false),
                ("detail", Utf8, true),
            ],
            Table::PrefixCache => vec![
                ("request_id", UInt64, false),
                ("tenant", Utf8, false),
                ("event", Utf8, false),
                ("page", UInt32, false),
                ("generation", UInt32, false),
                ("namespace", Utf8, false),
                ("scope", Utf8, false),
                ("scope_kind", Utf8, false),
                ("writer_request_id", UInt64, false),
                ("writer_tenant", Utf8, false),
                ("hit_tokens", UInt32, false),
            ],
            Table::RdmaMr => vec![
                ("ktime_ns", UInt64, false),
                ("pid", UInt32, false),
                ("tid", UInt32, false),
                ("op", Utf8, false),
                ("ctx", UInt64, false),
                ("addr", UInt64, false),
                ("len", UInt64, false),
                ("lkey", UInt32, false),
                ("rkey", UInt32, false),
                ("access", UInt32, false),
                ("status", Int32, false),
                ("probe_flags", Utf8, true),
            ],
        }
    }

    pub fn schema(self) -> SchemaRef {
        let mut fields = vec![
            Field::new("node_id", DataType::UInt32, false),
            Field::new("seq", DataType::UInt64, false),
            Field::new("ts_ns", DataType::UInt64, false),
            Field::new("wall_ns", DataType::Int64, false),
        ];
        fields.extend(
            self.columns()
                .into_iter()
                .map(|(n, t, null)| Field::new(n, t, null)),
        );
        let meta = [
            (SCHEMA_VERSION_KEY.to_owned(), SCHEMA_VERSION.to_owned()),
            ("custody.audit.table".to_owned(), self.name().to_owned()),
        ];
        Arc::new(Schema::new_with_metadata(
            fields,
            meta.into_iter().collect(),
        ))
    }
}

#[derive(Debug)]
enum Col {
    I32(Vec<i32>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    OptU32(Vec<Option<u32>>),
    OptU64(Vec<Option<u64>>),
    /// Appended into one contiguous buffer: no allocation per string.
    Str(StringBuilder),
    OptStr(StringBuilder),
}

/// Column builders of one table.
#[derive(Debug)]
pub struct TableBuilder {
    table: Table,
    node: Vec<u32>,
    seq: Vec<u64>,
    ts: Vec<u64>,
    wall: Vec<i64>,
    cols: Vec<Col>,
}

impl TableBuilder {
    pub fn new(table: Table) -> Self {
        let cols = table
            .columns()
            .into_iter()
            .map(|(_, t, null)| match (t, null) {
                (DataType::Int32, _) => Col::I32(Vec::new()),
                (DataType::UInt32, false) => Col::U32(Vec::new()),
                (DataType::UInt32, true) => Col::OptU32(Vec::new()),
                (DataType::UInt64, false) => Col::U64(Vec::new()),
                (DataType::UInt64, true) => Col::OptU64(Vec::new()),
                (DataType::Utf8, false) => Col::Str(StringBuilder::new()),
                (DataType::Utf8, true) => Col::OptStr(StringBuilder::new()),
                (t, _) => unreachable!("no column of type {t}"),
            })
            .collect();
        Self {
            table,
            node: Vec::new(),
            seq: Vec::new(),
            ts: Vec::new(),
            wall: Vec::new(),
            cols,
        }
    }

    pub fn len(&self) -> usize {
        self.seq.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }

    fn common(&mut self, node: u32, seq: u64, ts: u64, wall: i64) {
        self.node.push(node);
        self.seq.push(seq);
        self.ts.push(ts);
        self.wall.push(wall);
    }

    fn u32(&mut self, i: usize, v: u32) {
        let Col::U32(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not u32", self.table)
        };
        c.push(v);
    }
    fn i32(&mut self, i: usize, v: i32) {
        let Col::I32(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not i32", self.table)
        };
        c.push(v);
    }
    fn ou32(&mut self, i: usize, v: Option<u32>) {
        let Col::OptU32(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not u32?", self.table)
        };
        c.push(v);
    }
    fn ou64(&mut self, i: usize, v: Option<u64>) {
        let Col::OptU64(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not u64?", self.table)
        };
        c.push(v);
    }
    fn u64(&mut self, i: usize, v: u64) {
        let Col::U64(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not u64", self.table)
        };
        c.push(v);
    }
    fn s(&mut self, i: usize, v: &str) {
        let Col::Str(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not utf8", self.table)
        };
        c.append_value(v);
    }
    fn os(&mut self, i: usize, v: Option<&str>) {
        let Col::OptStr(c) = &mut self.cols[i] else {
            unreachable!("column {i} of {:?} is not utf8?", self.table)
        };
        c.append_option(v);
    }

    /// Append `ev` (which must belong to this table) as row `seq`.
    pub fn push(&mut self, node: u32, seq: u64, wall: i64, ev: &Event) {
        debug_assert_eq!(Table::of(ev), self.table);
        self.common(node, seq, ev.ts_ns(), wall);
        match ev {
            Event::Request {
                request,
                tenant,
                kind,
                prompt_tokens,
                output_tokens,
                ..
            } => {
                self.u64(0, *request);
                self.s(1, tenant);
                self.s(2, kind.name());
                self.os(3, kind.reason());
                self.u32(4, *prompt_tokens);
                self.u32(5, *output_tokens);
            }
            Event::Page {
                request,
                tenant,
                page,
                generation,
                kind,
                ..
            } => {
                self.u64(0, *request);
                self.s(1, tenant);
                self.s(2, kind.name());
                self.u32(3, *page);
                self.u32(4, *generation);
                match kind {
                    PageKind::Write {
                        slot_start,
                        slot_end,
                        writer,
                    } => {
                        self.ou32(5, Some(*slot_start));
                        self.ou32(6, Some(*slot_end));
                        self.os(
                            7,
                            Some(match writer {
                                Writer::Local => "local",
                                Writer::Transfer => "transfer",
                                Writer::Restore => "restore",
                            }),
                        );
                    }
                    _ => {
                        self.ou32(5, None);
                        self.ou32(6, None);
                        self.os(7, None);
                    }
                }
            }
            Event::Transfer {
                transfer,
                request,
                tenant,
                src_node,
                src_page,
                src_generation,
                dst_node,
                dst_page,
                dst_generation,
                bytes,
                checksum,
                outcome,
                rkey,
                remote_addr,
                remote_len,
                wire_bytes,
                work_requests,
                ..
            } => {
                self.u64(0, *transfer);
                self.u64(1, *request);
                self.s(2, tenant);
                self.u32(3, *src_node);
                self.u32(4, *src_page);
                self.u32(5, *src_generation);
                self.u32(6, *dst_node);
                self.u32(7, *dst_page);
                self.u32(8, *dst_generation);
                self.u64(9, *bytes);
                self.u64(10, *checksum);
                self.s(11, outcome);
                self.u32(12, *rkey);
                self.u64(13, *remote_addr);
                self.u64(14, *remote_len);
                self.u64(15, *wire_bytes);
                self.u32(16, *work_requests);
            }
            Event::RdmaOp(o) => {
                self.u64(0, o.ktime_ns);
                self.u32(1, o.pid);
                self.u32(2, o.tid);
                self.s(3, o.op);
                self.u64(4, o.ctx);
                self.u64(5, o.wr_id);
                self.u32(6, o.chain_index);
                self.u32(7, o.opcode);
                self.u32(8, o.flags);
                self.u32(9, o.imm);
                self.u64(10, o.remote_addr);
                self.u32(11, o.rkey);
                self.u32(12, o.num_sge);
                self.u64(13, o.bytes);
                self.i32(14, o.status);
                self.u32(15, o.qp_num);
                self.os(16, o.sges.as_deref());
                self.os(17, o.probe_flags.as_deref());
            }
            Event::RdmaMr(m) => {
                self.u64(0, m.ktime_ns);
                self.u32(1, m.pid);
                self.u32(2, m.tid);
                self.s(3, m.op);
                self.u64(4, m.ctx);
                self.u64(5, m.addr);
                self.u64(6, m.len);
                self.u32(7, m.lkey);
                self.u32(8, m.rkey);
                self.u32(9, m.access);
                self.i32(10, m.status);
                self.os(11, m.probe_flags.as_deref());
            }
            Event::Read {
                request,
                tenant,
                page,
                generation,
                slot_start,
                slot_end,
                first_step,
                last_step,
                verified,
                ..
            } => {
                self.u64(0, *request);
                self.s(1, tenant);
                self.u32(2, *page);
                self.u32(3, *generation);
                self.u32(4, *slot_start);
                self.u32(5, *slot_end);
                self.u32(6, *first_step);
                self.u32(7, *last_step);
                self.s(8, if *verified { "verified" } else { "unchecked" });
            }
            Event::IntegrityViolation {
                request,
                tenant,
                page,
                generation,
                kind,
                detail,
                ..
            } => {
                self.u64(0, *request);
                self.s(1, tenant);
                self.ou32(2, *page);
                self.ou32(3, *generation);
                self.s(4, kind);
                self.s(5, detail);
            }
            Event::Node { kind, detail, .. } => {
                self.s(0, kind);
                self.s(1, detail);
            }
            Event::Cache(c) => {
                self.u64(0, c.request);
                self.s(1, &c.tenant);
                self.s(2, c.event.name());
                self.u32(3, c.page);
                self.u32(4, c.generation);
                self.s(5, &format!("{:016x}", c.namespace));
                self.s(6, &c.scope);
                self.s(7, c.scope_kind);
                self.u64(8, c.writer);
                self.s(9, &c.writer_tenant);
                self.u32(10, c.hit_tokens);
            }
            Event::Offload(o) => {
                self.u64(0, o.request);
                self.s(1, &o.tenant);
                self.s(2, o.event.name());
                self.s(3, o.tier);
                self.ou32(4, o.page);
                self.ou32(5, o.generation);
                self.s(6, &hex32(&o.key));
                self.os(7, o.namespace.map(|n| format!("{n:016x}")).as_deref());
                self.os(8, o.scope.as_deref());
                self.ou32(9, o.writer_node);
                self.ou64(10, o.writer_request);
                self.os(11, o.writer_tenant.as_deref());
                self.u64(12, o.bytes);
                self.os(13, o.detail.as_deref());
            }
            Event::Decoding(d) => {
                self.u64(0, d.request);
                self.s(1, &d.tenant);
                self.os(2, d.constraint_kind);
                self.os(3, d.constraint_sha256.as_deref());
                self.u32(4, d.n);
                self.ou32(5, d.top_logprobs);
                self.u32(6, d.logit_bias_tokens);
                self.i32(7, d.presence_penalty_milli);
                self.i32(8, d.frequency_penalty_milli);
            }
            Event::Tools(t) => {
                self.u64(0, t.request);
                self.s(1, &t.tenant);
                self.s(2, t.format);
                self.s(3, &t.tool_choice);
                // Function names are `[A-Za-z0-9_-]`: a comma never occurs inside one.
                self.s(4, &t.offered.join(","));
                self.s(5, &t.called.join(","));
                self.u32(6, t.called.len() as u32);
            }
        }
    }

    /// A writer record (WriterEvents table).
    pub fn push_writer_event(
        &mut self,
        node: u32,
        seq: u64,
        ts: u64,
        wall: i64,
        event: &str,
        count: u64,
    ) {
        debug_assert_eq!(self.table, Table::WriterEvents);
        self.common(node, seq, ts, wall);
        self.s(0, event);
        self.u64(1, count);
    }

    /// Take the buffered rows as a record batch (the builder is left empty).
    pub fn finish(&mut self) -> RecordBatch {
        let mut arrays: Vec<ArrayRef> = vec![
            Arc::new(UInt32Array::from(std::mem::take(&mut self.node))),
            Arc::new(UInt64Array::from(std::mem::take(&mut self.seq))),
            Arc::new(UInt64Array::from(std::mem::take(&mut self.ts))),
            Arc::new(Int64Array::from(std::mem::take(&mut self.wall))),
        ];
        for c in &mut self.cols {
            arrays.push(match c {
                Col::I32(v) => Arc::new(Int32Array::from(std::mem::take(v))),
                Col::U32(v) => Arc::new(UInt32Array::from(std::mem::take(v))),
                Col::OptU32(v) => Arc::new(UInt32Array::from(std::mem::take(v))),
                Col::U64(v) => Arc::new(UInt64Array::from(std::mem::take(v))),
                Col::OptU64(v) => Arc::new(UInt64Array::from(std::mem::take(v))),
                Col::Str(v) | Col::OptStr(v) => Arc::new(v.finish()),
            });
        }
        match RecordBatch::try_new(self.table.schema(), arrays) {
            Ok(b) => b,
            Err(e) => unreachable!("builder columns match the schema by construction: {e}"),
        }
    }
}

/// `rows` as one `rdma_ops` record batch: rows `seq_start..seq_start + rows.len()` of `node`,
/// `wall_ns` from `ts_ns` by `wall`. The numeric columns move into Arrow without a copy.
pub fn rdma_ops_batch(
    node: u32,
    seq_start: u64,
    wall: impl Fn(u64) -> i64,
    rows: RdmaOpRows,
) -> RecordBatch {
    assert!(rows.is_rectangular(), "rdma_ops columns of unequal length");
    let n = rows.len();
    let wall: Vec<i64> = rows.ts_ns.iter().map(|&t| wall(t)).collect();
    let arrays: Vec<ArrayRef> = vec![
        Arc::new(UInt32Array::from(vec![node; n])),
        Arc::new(UInt64Array::from_iter_values(
            seq_start..seq_start + n as u64,
        )),
        Arc::new(UInt64Array::from(rows.ts_ns)),
        Arc::new(Int64Array::from(wall)),
        Arc::new(UInt64Array::from(rows.ktime_ns)),
        Arc::new(UInt32Array::from(rows.pid)),
        Arc::new(UInt32Array::from(rows.tid)),
        Arc::new(StringArray::from_iter_values(rows.op)),
        Arc::new(UInt64Array::from(rows.ctx)),
        Arc::new(UInt64Array::from(rows.wr_id)),
        Arc::new(UInt32Array::from(rows.chain_index)),
        Arc::new(UInt32Array::from(rows.opcode)),
        Arc::new(UInt32Array::from(rows.flags)),
        Arc::new(UInt32Array::from(rows.imm)),
        Arc::new(UInt64Array::from(rows.remote_addr)),
        Arc::new(UInt32Array::from(rows.rkey)),
        Arc::new(UInt32Array::from(rows.num_sge)),
        Arc::new(UInt64Array::from(rows.bytes)),
        Arc::new(Int32Array::from(rows.status)),
        Arc::new(UInt32Array::from(rows.qp_num)),
        Arc::new(StringArray::from(rows.sges)),
        Arc::new(StringArray::from(rows.probe_flags)),
    ];
    match RecordBatch::try_new(Table::RdmaOps.schema(), arrays) {
        Ok(b) => b,
        Err(e) => unreachable!("rdma_ops columns match the schema by construction: {e}"),
    }
}

/// Lower-case hex of a 32-byte key.
fn hex32(b: &[u8; 32]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RdmaOp;

    /// The columnar path builds exactly the batch the event path builds from the same rows.
    #[test]
    fn rdma_ops_batch_equals_the_event_builders_batch() {
        let ops: Vec<RdmaOp> = (0..5u64)
            .map(|i| RdmaOp {
                ts_ns: 100 + i,
                ktime_ns: 900 + i,
                pid: 1,
                tid: 2 + i as u32,
                op: ["post_write", "complete"][i as usize % 2],
                ctx: 7,
                wr_id: i << 16,
                chain_index: i as u32,
                opcode: 1,
                flags: 2,
                imm: 3,
                remote_addr: 0x1000 * i,
                rkey: 4,
                num_sge: 5,
                bytes: 6 * i,
                status: -1,
                qp_num: 8,
                sges: (i == 3).then(|| "0x1:2:3".to_owned()),
                probe_flags: (i == 4).then(|| "sge_truncated".to_owned()),
            })
            .collect();
        let wall = |ts: u64| ts as i64 * 10;
        let mut b = TableBuilder::new(Table::RdmaOps);
        for (i, o) in ops.iter().enumerate() {
            b.push(
                9,
                40 + i as u64,
                wall(o.ts_ns),
                &Event::RdmaOp(Box::new(o.clone())),
            );
        }
        let mut rows = RdmaOpRows::default();
        ops.into_iter().for_each(|o| rows.push(o));
        assert_eq!(rdma_ops_batch(9, 40, wall, rows), b.finish());
    }

    #[test]
    #[should_panic(expected = "unequal length")]
    fn rdma_ops_batch_refuses_ragged_columns() {
        let mut rows = RdmaOpRows::default();
        rows.push(RdmaOp::default());
        rows.wr_id.push(1);
        let _ = rdma_ops_batch(0, 0, |t| t as i64, rows);
    }
}
