"""Decoder for Custody's canonical record encoding (docs/audit-schema.md, "Merkle tree"):

    record  = "custody.audit.record/1" 0x00  u8 len || table  u16 columns  column*
    column  = u8 len || name  tag  value
    tag     = 0 null | 1 u32 | 2 u64 | 3 i32 | 4 i64 | 5 utf8 (u32 length || bytes)
    lost    = "custody.audit.lost/1" 0x00  u32 node  u64 seq

Integers are big-endian; every `len` is a byte length of UTF-8. Table and column names are
non-empty and a column name appears once; a record always has a `seq` column (u64), since it
holds every column of its table, the common ones (`node_id`, `seq`, `ts_ns`, `wall_ns`) first.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from . import VerifyError

RECORD_MAGIC = b"custody.audit.record/1\x00"
LOST_MAGIC = b"custody.audit.lost/1\x00"

Value = Optional[Union[int, str]]

TAG_NULL, TAG_U32, TAG_U64, TAG_I32, TAG_I64, TAG_UTF8 = range(6)
_INT_FORMATS = {TAG_U32: ">I", TAG_U64: ">Q", TAG_I32: ">i", TAG_I64: ">q"}
TAG_NAMES = {TAG_NULL: "null", TAG_U32: "u32", TAG_U64: "u64", TAG_I32: "i32", TAG_I64: "i64", TAG_UTF8: "utf8"}


@dataclass(frozen=True)
class Record:
    table: str
    columns: List[Tuple[str, Value]]
    tags: List[int] = field(default_factory=list, compare=False)  # each column's tag, in order

    def get(self, name: str) -> Value:
        for column, value in self.columns:
            if column == name:
                return value
        return None

    def tag(self, name: str) -> Optional[int]:
        """The tag of column `name` (TAG_*), or None if the record has no such column."""
        for (column, _), tag in zip(self.columns, self.tags):
            if column == name:
                return tag
        return None


@dataclass(frozen=True)
class LostRecord:
    """The placeholder leaf of a sequence number whose record never reached disk."""

    node: int
    seq: int


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise VerifyError(f"record truncated reading {what} at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def text(self, n: int, what: str) -> str:
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise VerifyError(f"record {what} is not valid UTF-8: {e}") from e

    def finish(self) -> None:
        if self.pos != len(self.data):
            raise VerifyError(f"record has {len(self.data) - self.pos} trailing byte(s)")


def decode_record(data: bytes) -> Union[Record, LostRecord]:
    """Decode a leaf's record bytes, or its `lost` placeholder."""
    if data.startswith(LOST_MAGIC):
        r = _Reader(data[len(LOST_MAGIC) :])
        lost = LostRecord(r.unpack(">I", "lost node"), r.unpack(">Q", "lost seq"))
        r.finish()
        return lost
    if not data.startswith(RECORD_MAGIC):
        raise VerifyError("not a Custody record: missing the custody.audit.record/1 (or lost/1) prefix")
    r = _Reader(data[len(RECORD_MAGIC) :])
    table = r.text(r.unpack(">B", "table name length"), "table name")
    if not table:
        raise VerifyError("record has an empty table name")
    count = r.unpack(">H", "column count")
    columns: List[Tuple[str, Value]] = []
    tags: List[int] = []
    seen = set()
    for i in range(count):
        name, tag, value = _decode_column(r, i)
        if name in seen:
            raise VerifyError(f"record of table {table!r} has column {name!r} twice")
        seen.add(name)
        columns.append((name, value))
        tags.append(tag)
    r.finish()
    record = Record(table, columns, tags)
    if "seq" not in seen:
        raise VerifyError(f"record of table {table!r} has no seq column")
    if record.tag("seq") != TAG_U64:
        raise VerifyError(f"record of table {table!r} has a seq column of type "
                          f"{TAG_NAMES[record.tag('seq')]}, not u64")
    return record


def _decode_column(r: _Reader, i: int) -> Tuple[str, int, Value]:
    name = r.text(r.unpack(">B", f"column {i} name length"), f"column {i} name")
    if not name:
        raise VerifyError(f"record column {i} has an empty name")
    tag = r.unpack(">B", f"column {name!r} tag")
    if tag == TAG_NULL:
        return name, tag, None
    if tag in _INT_FORMATS:
        return name, tag, r.unpack(_INT_FORMATS[tag], f"column {name!r} value")
    if tag == TAG_UTF8:
        return name, tag, r.text(r.unpack(">I", f"column {name!r} length"), f"column {name!r} value")
    raise VerifyError(f"column {name!r} has unknown tag {tag}")
