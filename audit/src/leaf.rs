//! The Merkle tree's leaves: one per node sequence number, so leaf index = `seq` and the tree
//! of a node's first `n` records has size `n`.
//!
//! A record's leaf is RFC 6962's `SHA-256(0x00 ‖ record)` over its canonical bytes
//! ([`encode_record`]); a sequence number whose record never reached disk (declared in a digest
//! as `lost_unacknowledged`) gets the leaf of [`lost_record`]. The bytes are self-describing (the
//! table's and each column's name travel with the values), so a verifier written from
//! `docs/audit-schema.md` decodes a record it is handed without the schema:
//!
//! ```text
//! record  = "custody.audit.record/1" 0x00  u8 len ‖ table  u16 columns  column*
//! column  = u8 len ‖ name  tag  value
//! tag     = 0 null | 1 u32 | 2 u64 | 3 i32 | 4 i64 (big-endian) | 5 utf8 (u32 length ‖ bytes)
//! lost    = "custody.audit.lost/1" 0x00  u32 node  u64 seq
//! ```
//! Columns in the table's schema order (`node_id`, `seq`, `ts_ns`, `wall_ns` first).

use std::collections::BTreeMap;

use arrow::array::{
    Array, Int32Array, Int64Array, RecordBatch, StringArray, UInt32Array, UInt64Array,
};
use arrow::datatypes::DataType;
use tlog_tiles::{Hash, record_hash};

use crate::schema::Table;

/// Prefix of a record's canonical bytes (the encoding's version).
pub const RECORD_PREFIX: &[u8] = b"custody.audit.record/1\0";
/// Prefix of a lost sequence number's placeholder record.
pub const LOST_PREFIX: &[u8] = b"custody.audit.lost/1\0";

/// Why a segment's rows do not make one leaf per sequence number.
#[derive(Debug, thiserror::Error)]
pub enum LeafError {
    #[error("table {table}: column {column} has type {data_type}, which has no canonical encoding")]
    UnsupportedType {
        table: &'static str,
        column: String,
        data_type: DataType,
    },
    #[error("table {table}: its second column is not the u64 `seq`")]
    NoSeq { table: &'static str },
    #[error("seq {seq} is outside the segment's {start}..{end}")]
    OutOfRange { seq: u64, start: u64, end: u64 },
    #[error("seq {seq} appears twice in the segment")]
    Duplicate { seq: u64 },
}

/// One column of a batch, typed once per batch (not per row).
#[derive(Debug)]
enum Column<'a> {
    U32(&'a UInt32Array),
    U64(&'a UInt64Array),
    I32(&'a Int32Array),
    I64(&'a Int64Array),
    Utf8(&'a StringArray),
}

/// Writes the canonical bytes of a batch's rows.
#[derive(Debug)]
pub struct RecordEncoder<'a> {
    table: &'static str,
    names: Vec<&'a str>,
    columns: Vec<Column<'a>>,
}

impl<'a> RecordEncoder<'a> {
    pub fn new(table: Table, batch: &'a RecordBatch) -> Result<Self, LeafError> {
        let schema = batch.schema_ref();
        let mut columns = Vec::with_capacity(batch.num_columns());
        let mut names = Vec::with_capacity(batch.num_columns());
        for (field, array) in schema.fields().iter().zip(batch.columns()) {
            let any = array.as_any();
            let col = match field.data_type() {
                DataType::UInt32 => any.downcast_ref().map(Column::U32),
                DataType::UInt64 => any.downcast_ref().map(Column::U64),
                DataType::Int32 => any.downcast_ref().map(Column::I32),
                DataType::Int64 => any.downcast_ref().map(Column::I64),
                DataType::Utf8 => any.downcast_ref().map(Column::Utf8),
                _ => None,
            };
            let col = col.ok_or_else(|| LeafError::UnsupportedType {
                table: table.name(),
                column: field.name().clone(),
                data_type: field.data_type().clone(),
            })?;
            columns.push(col);
            names.push(field.name().as_str());
        }
        Ok(Self {
            table: table.name(),
            names,
            columns,
        })
    }

    /// Appends row `row`'s canonical bytes to `out`.
    pub fn encode(&self, row: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(RECORD_PREFIX);
        put_name(out, self.table);
        out.extend_from_slice(&(self.columns.len() as u16).to_be_bytes());
        for (name, col) in self.names.iter().zip(&self.columns) {
            put_name(out, name);
            put_value(out, col, row);
        }
    }
}

/// `u8 len ‖ bytes`: table and column names are short ASCII identifiers (asserted).
fn put_name(out: &mut Vec<u8>, name: &str) {
    debug_assert!(name.len() <= usize::from(u8::MAX));
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
}

fn put_value(out: &mut Vec<u8>, col: &Column<'_>, row: usize) {
    let null = match col {
        Column::U32(a) => a.is_null(row),
        Column::U64(a) => a.is_null(row),
        Column::I32(a) => a.is_null(row),
        Column::I64(a) => a.is_null(row),
        Column::Utf8(a) => a.is_null(row),
    };
    if null {
        out.push(0);
        return;
    }
    match col {
        Column::U32(a) => {
            out.push(1);
            out.extend_from_slice(&a.value(row).to_be_bytes());
        }
        Column::U64(a) => {
            out.push(2);
            out.extend_from_slice(&a.value(row).to_be_bytes());
        }
        Column::I32(a) => {
            out.push(3);
            out.extend_from_slice(&a.value(row).to_be_bytes());
        }
        Column::I64(a) => {
            out.push(4);
            out.extend_from_slice(&a.value(row).to_be_bytes());
        }
        Column::Utf8(a) => {
            let v = a.value(row).as_bytes();
            out.push(5);
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            out.extend_from_slice(v);
        }
    }
}

/// The placeholder record of a sequence number lost before it reached disk.
pub fn lost_record(node: u32, seq: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(LOST_PREFIX.len() + 12);
    out.extend_from_slice(LOST_PREFIX);
    out.extend_from_slice(&node.to_be_bytes());
    out.extend_from_slice(&seq.to_be_bytes());
    out
}

/// A flushed row's leaf, and the request it is a record of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowLeaf {
    pub seq: u64,
    pub leaf: Hash,
    /// Its `request_id`, when its table has one and it is set.
    pub request: Option<u64>,
    /// A `requests` row other than `admitted`: how the request ended.
    pub end: bool,
}

/// The leaves of a batch's rows, in row order.
pub fn batch_leaves(table: Table, batch: &RecordBatch) -> Result<Vec<RowLeaf>, LeafError> {
    let enc = RecordEncoder::new(table, batch)?;
    let seqs = batch
        .column(1)
        .as_any()
        .downcast_ref::<UInt64Array>()
        .ok_or(LeafError::NoSeq {
            table: table.name(),
        })?;
    let requests = batch
        .column_by_name("request_id")
        .and_then(|c| c.as_any().downcast_ref::<UInt64Array>());
    let events = (table == Table::Requests)
        .then(|| batch.column_by_name("event"))
        .flatten()
        .and_then(|c| c.as_any().downcast_ref::<StringArray>());
    let mut buf = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(batch.num_rows());
    for (row, &seq) in seqs.values().iter().enumerate() {
        buf.clear();
        enc.encode(row, &mut buf);
        out.push(RowLeaf {
            seq,
            leaf: record_hash(&buf),
            request: requests.and_then(|r| r.is_valid(row).then(|| r.value(row))),
            end: events.is_some_and(|e| e.is_valid(row) && e.value(row) != "admitted"),
        });
    }
    Ok(out)
}

/// A segment's leaves as its rows come (any table, any order), from sequence number `start`.
#[derive(Debug)]
pub struct SegmentLeaves {
    node: u32,
    start: u64,
    slots: Vec<Option<Hash>>,
    rows: usize,
}

impl SegmentLeaves {
    pub fn new(node: u32, start: u64) -> Self {
        Self {
            node,
            start,
            slots: Vec::new(),
            rows: 0,
        }
    }

    /// Rows placed so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The leaf of `seq`; a number before the segment's start, or placed twice, is an error.
    pub fn place(&mut self, seq: u64, leaf: Hash) -> Result<(), LeafError> {
        let Some(i) = seq.checked_sub(self.start) else {
            return Err(LeafError::OutOfRange {
                seq,
                start: self.start,
                end: u64::MAX,
            });
        };
        let i = i as usize;
        if self.slots.len() <= i {
            self.slots.resize(i + 1, None);
        }
        if self.slots[i].replace(leaf).is_some() {
            return Err(LeafError::Duplicate { seq });
        }
        self.rows += 1;
        Ok(())
    }

    /// The leaves of `start..end` in sequence order, a lost placeholder where no row has that
    /// number; a row at or past `end` is an error.
    pub fn finish(mut self, end: u64) -> Result<Vec<Hash>, LeafError> {
        debug_assert!(self.start <= end);
        let n = (end - self.start) as usize;
        if let Some(past) = self.slots.iter().skip(n).position(Option::is_some) {
            return Err(LeafError::OutOfRange {
                seq: self.start + (n + past) as u64,
                start: self.start,
                end,
            });
        }
        self.slots.resize(n, None);
        Ok(self
            .slots
            .into_iter()
            .zip(self.start..end)
            .map(|(l, seq)| l.unwrap_or_else(|| record_hash(&lost_record(self.node, seq))))
            .collect())
    }
}

/// The leaves of sequence numbers `start..end` from a segment's batches (any table, any order),
/// in sequence order: each row's record hash at index `seq - start`, a lost placeholder where no
/// row has that number. A row outside the range, or two rows with one number, is an error.
pub fn segment_leaves<'a>(
    node: u32,
    start: u64,
    end: u64,
    batches: impl IntoIterator<Item = (Table, &'a RecordBatch)>,
) -> Result<Vec<Hash>, LeafError> {
    let mut leaves = SegmentLeaves::new(node, start);
    for (table, batch) in batches {
        for r in batch_leaves(table, batch)? {
            if r.seq >= end {
                return Err(LeafError::OutOfRange {
                    seq: r.seq,
                    start,
                    end,
                });
            }
            leaves.place(r.seq, r.leaf)?;
        }
    }
    leaves.finish(end)
}

/// [`segment_leaves`] over a map of tables to their batches.
pub fn leaves_of_tables(
    node: u32,
    start: u64,
    end: u64,
    batches: &BTreeMap<Table, Vec<RecordBatch>>,
) -> Result<Vec<Hash>, LeafError> {
    segment_leaves(
        node,
        start,
        end,
        batches
            .iter()
            .flat_map(|(t, bs)| bs.iter().map(move |b| (*t, b))),
    )
}

/// A decoded record: its table and each column's value (`None`: null).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedRecord {
    pub table: String,
    pub columns: Vec<(String, Option<Value>)>,
}

/// A column's value in a decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    U32(u32),
    U64(u64),
    I32(i32),
    I64(i64),
    Utf8(String),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::U32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::Utf8(v) => write!(f, "{v:?}"),
        }
    }
}

/// Why bytes are not a canonical record.
#[derive(Debug, thiserror::Error)]
#[error("not a canonical audit record: {0}")]
pub struct DecodeError(&'static str);

/// Reads canonical record bytes back ([`RecordEncoder::encode`]'s inverse), refusing trailing
/// bytes, unknown tags and invalid UTF-8.
pub fn decode_record(bytes: &[u8]) -> Result<DecodedRecord, DecodeError> {
    let mut r = bytes
        .strip_prefix(RECORD_PREFIX)
        .ok_or(DecodeError("no custody.audit.record/1 prefix"))?;
    let mut take = |n: usize| -> Result<&[u8], DecodeError> {
        if r.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (a, b) = r.split_at(n);
        r = b;
        Ok(a)
    };
    fn name(b: &[u8]) -> Result<String, DecodeError> {
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError("a name is not UTF-8"))
    }
    let n = take(1)?[0] as usize;
    let table = name(take(n)?)?;
    let count = u16::from_be_bytes([take(1)?[0], take(1)?[0]]);
    let mut columns = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let n = take(1)?[0] as usize;
        let col = name(take(n)?)?;
        let value = match take(1)?[0] {
            0 => None,
            1 => Some(Value::U32(u32::from_be_bytes(arr(take(4)?)?))),
            2 => Some(Value::U64(u64::from_be_bytes(arr(take(8)?)?))),
            3 => Some(Value::I32(i32::from_be_bytes(arr(take(4)?)?))),
            4 => Some(Value::I64(i64::from_be_bytes(arr(take(8)?)?))),
            5 => {
                let len = u32::from_be_bytes(arr(take(4)?)?) as usize;
                let v = String::from_utf8(take(len)?.to_vec())
                    .map_err(|_| DecodeError("a string is not UTF-8"))?;
                Some(Value::Utf8(v))
            }
            _ => return Err(DecodeError("unknown value tag")),
        };
        columns.push((col, value));
    }
    if !r.is_empty() {
        return Err(DecodeError("bytes after the last column"));
    }
    Ok(DecodedRecord { table, columns })
}

fn arr<const N: usize>(b: &[u8]) -> Result<[u8; N], DecodeError> {
    b.try_into().map_err(|_| DecodeError("truncated"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::datatypes::{Field, Schema};

    use super::*;

    fn batch(seqs: &[u64]) -> RecordBatch {
        let n = seqs.len();
        let schema = Schema::new(vec![
            Field::new("node_id", DataType::UInt32, false),
            Field::new("seq", DataType::UInt64, false),
            Field::new("tenant", DataType::Utf8, true),
            Field::new("delta", DataType::Int64, false),
            Field::new("n", DataType::Int32, false),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(UInt32Array::from(vec![3; n])),
                Arc::new(UInt64Array::from(seqs.to_vec())),
                Arc::new(StringArray::from(
                    (0..n)
                        .map(|i| (i % 2 == 1).then_some("acme"))
                        .collect::<Vec<_>>(),
                )),
                Arc::new(Int64Array::from(vec![-2; n])),
                Arc::new(Int32Array::from(vec![5; n])),
            ],
        )
        .expect("batch")
    }

    /// The encoding, byte for byte, as `docs/audit-schema.md` documents it.
    #[test]
    fn records_encode_as_documented() {
        let b = batch(&[7, 8]);
        let enc = RecordEncoder::new(Table::Requests, &b).expect("encoder");
        let mut got = Vec::new();
        enc.encode(0, &mut got);
        let mut want = b"custody.audit.record/1\0".to_vec();
        want.extend_from_slice(b"\x08requests\x00\x05");
        want.extend_from_slice(b"\x07node_id\x01\x00\x00\x00\x03");
        want.extend_from_slice(b"\x03seq\x02\x00\x00\x00\x00\x00\x00\x00\x07");
        want.extend_from_slice(b"\x06tenant\x00");
        want.extend_from_slice(b"\x05delta\x04\xff\xff\xff\xff\xff\xff\xff\xfe");
        want.extend_from_slice(b"\x01n\x03\x00\x00\x00\x05");
        assert_eq!(got, want);
        got.clear();
        enc.encode(1, &mut got);
        let tenant = b"\x06tenant\x05\x00\x00\x00\x04acme";
        assert!(got.windows(tenant.len()).any(|w| w == tenant));
        let back = decode_record(&want).expect("decode");
        assert_eq!(back.table, "requests");
        assert_eq!(back.columns[1], ("seq".to_owned(), Some(Value::U64(7))));
        assert_eq!(back.columns[2], ("tenant".to_owned(), None));
        assert_eq!(back.columns[3], ("delta".to_owned(), Some(Value::I64(-2))));
        assert!(decode_record(&got).is_ok());
        assert!(decode_record(&want[..want.len() - 1]).is_err());
        assert!(decode_record(&[want.as_slice(), b"x"].concat()).is_err());
        assert_eq!(
            lost_record(3, 9),
            b"custody.audit.lost/1\0\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00\x09"
        );
    }

    /// One leaf per number: rows in any order, a lost number's placeholder; a number outside
    /// the segment or seen twice is an error.
    #[test]
    fn a_segment_has_one_leaf_per_sequence_number() {
        let b = batch(&[12, 10]);
        let leaves = segment_leaves(3, 10, 13, [(Table::Requests, &b)]).expect("leaves");
        let enc = RecordEncoder::new(Table::Requests, &b).expect("encoder");
        let leaf = |row| {
            let mut v = Vec::new();
            enc.encode(row, &mut v);
            record_hash(&v)
        };
        assert_eq!(leaves, [leaf(1), record_hash(&lost_record(3, 11)), leaf(0)]);
        assert!(matches!(
            segment_leaves(3, 10, 12, [(Table::Requests, &b)]),
            Err(LeafError::OutOfRange { seq: 12, .. })
        ));
        assert!(matches!(
            segment_leaves(3, 10, 13, [(Table::Requests, &b), (Table::Requests, &b)]),
            Err(LeafError::Duplicate { .. })
        ));
    }
}
