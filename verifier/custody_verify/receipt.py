"""Custody receipts (`custody-receipt/1`): every record of one request of one tenant, each with
its c2sp.org/tlog-proof@v1 inclusion proof, all to one signed checkpoint.

    {"format": "custody-receipt/1", "node": 5, "request_id": "req-5-12", "tenant": "acme",
     "origin": "<log origin>", "tree_size": 1234, "checkpoint": "<signed checkpoint note>",
     "records": [{"table": "requests", "seq": 17, "proof": "<tlog-proof text>"}, ...]}

Each proof's `extra` is the record's canonical bytes, its `index` the record's seq, and its
checkpoint is byte for byte the receipt's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple, Union

from . import VerifyError
from .merkle import leaf_hash, verify_inclusion
from .notes import VerifiedCheckpoint, VerifierKey, parse_checkpoint, parse_note, verify_checkpoint
from .proofs import check_seq, parse_tlog_proof
from .records import TAG_NAMES, TAG_U64, TAG_UTF8, LostRecord, Record, decode_record

RECEIPT_FORMAT = "custody-receipt/1"
MAX_RECEIPT_SIZE = 64 << 20
U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class ReceiptRecord:
    seq: int
    record: Record
    leaf: bytes  # its leaf hash, SHA-256(0x00 || the record's bytes)


@dataclass(frozen=True)
class ReceiptResult:
    request_id: str
    tenant: str
    node: int
    verified: VerifiedCheckpoint
    records: List[ReceiptRecord]  # in the receipt's order


def _field(obj: Dict[str, Any], name: str, kind: type, what: str = "receipt") -> Any:
    if name not in obj:
        raise VerifyError(f"{what} has no {name!r}")
    value = obj[name]
    # bool is an int in Python; JSON true/false is not a number here.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        kind_name = {str: "a string", int: "an integer", list: "a list", bool: "a boolean",
                     dict: "an object"}.get(kind, kind.__name__)
        raise VerifyError(f"{what}'s {name!r} is not {kind_name}: {value!r}")
    if kind is int and not 0 <= value <= U64_MAX:
        raise VerifyError(f"{what}'s {name!r} {value} is not a u64")
    return value


def _request_number(request_id: str) -> int:
    """The number after the last '-' of a request id such as "req-5-12"."""
    _, dash, tail = request_id.rpartition("-")
    if not dash or not re.fullmatch(r"[0-9]+", tail) or int(tail) > U64_MAX:
        raise VerifyError(f"request_id {request_id!r} does not end in '-<number>'")
    return int(tail)


def _column(record: Record, name: str, tag: int, expected: Union[int, str]) -> None:
    have = record.tag(name)
    if have is None:
        raise VerifyError(f"the record has no {name} column")
    if have != tag:
        raise VerifyError(f"the record's {name} is of type {TAG_NAMES.get(have, have)}, not {TAG_NAMES[tag]}")
    value = record.get(name)
    if value != expected:
        raise VerifyError(f"the record's {name} is {value!r}, not the receipt's {expected!r}")


def parse_receipt(data: Union[bytes, str]) -> Dict[str, Any]:
    if isinstance(data, bytes):
        if len(data) > MAX_RECEIPT_SIZE:
            raise VerifyError(f"receipt is larger than {MAX_RECEIPT_SIZE} bytes")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise VerifyError(f"receipt is not valid UTF-8: {e}") from e
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, RecursionError) as e:
        raise VerifyError(f"receipt is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise VerifyError("receipt is not a JSON object")
    return obj


def verify_receipt(
    data: Union[bytes, str],
    log_key: VerifierKey,
    witness_keys: Sequence[VerifierKey] = (),
    min_witnesses: int = 0,
) -> ReceiptResult:
    """Check a receipt: its signed checkpoint (log key, cosignatures), and that every record
    it lists is in that checkpoint's tree and belongs to its request and tenant."""
    return verify_receipt_object(parse_receipt(data), log_key, witness_keys, min_witnesses)


def verify_receipt_object(
    obj: Dict[str, Any],
    log_key: VerifierKey,
    witness_keys: Sequence[VerifierKey] = (),
    min_witnesses: int = 0,
) -> ReceiptResult:
    """verify_receipt of a receipt already parsed from JSON (one embedded in a notice, say)."""
    if not isinstance(obj, dict):
        raise VerifyError("receipt is not a JSON object")
    fmt = obj.get("format")
    if fmt != RECEIPT_FORMAT:
        raise VerifyError(f"receipt format is {fmt!r}, not {RECEIPT_FORMAT!r}")
    node = _field(obj, "node", int)
    request_id = _field(obj, "request_id", str)
    request_number = _request_number(request_id)
    tenant = _field(obj, "tenant", str)
    origin = _field(obj, "origin", str)
    tree_size = _field(obj, "tree_size", int)
    note = _field(obj, "checkpoint", str)
    entries = _field(obj, "records", list)

    claimed = parse_checkpoint(parse_note(note.encode("utf-8")).text)
    if claimed.origin != origin:
        raise VerifyError(f"receipt origin {origin!r} is not the checkpoint's origin {claimed.origin!r}")
    verified = verify_checkpoint(note.encode("utf-8"), log_key, witness_keys, min_witnesses)
    cp = verified.checkpoint
    if tree_size != cp.size:
        raise VerifyError(f"receipt tree_size {tree_size} is not the checkpoint's size {cp.size}")

    if not entries:
        raise VerifyError("receipt has no records")
    records: List[ReceiptRecord] = []
    seen = set()
    for i, entry in enumerate(entries):
        what = f"receipt record {i}"
        if not isinstance(entry, dict):
            raise VerifyError(f"{what} is not a JSON object")
        table = _field(entry, "table", str, what)
        seq = _field(entry, "seq", int, what)
        proof_text = _field(entry, "proof", str, what)
        what = f"record {i} ({table} seq {seq})"
        if seq in seen:
            raise VerifyError(f"{what}: seq {seq} is listed twice")
        seen.add(seq)
        try:
            record, leaf = _verify_entry(table, seq, proof_text, note, cp, node, request_number, tenant)
        except VerifyError as e:
            raise VerifyError(f"{what}: {e}") from e
        records.append(ReceiptRecord(seq, record, leaf))
    if not any(r.record.table == "requests" for r in records):
        raise VerifyError("receipt has no record of table requests")
    return ReceiptResult(request_id, tenant, node, verified, records)


def _verify_entry(table: str, seq: int, proof_text: str, note: str, cp: Any, node: int,
                  request_number: int, tenant: str) -> Tuple[Record, bytes]:
    """The entry's record, checked, and its leaf hash."""
    proof = parse_tlog_proof(proof_text)
    if proof.checkpoint.encode("utf-8") != note.encode("utf-8"):
        raise VerifyError("its proof's checkpoint is not the receipt's checkpoint")
    if proof.index != seq:
        raise VerifyError(f"its proof is of index {proof.index}, not its seq {seq}")
    if proof.extra is None:
        raise VerifyError("its proof has no extra data (the record's bytes)")
    leaf = leaf_hash(proof.extra)
    verify_inclusion(proof.index, cp.size, leaf, proof.proof, cp.root)
    record = decode_record(proof.extra)
    if isinstance(record, LostRecord):
        raise VerifyError(f"it is the placeholder of a lost record (node {record.node}, seq {record.seq}), "
                          "not a record")
    check_seq(record, proof.index)
    if record.table != table:
        raise VerifyError(f"the record is of table {record.table!r}, not {table!r}")
    _column(record, "tenant", TAG_UTF8, tenant)
    _column(record, "request_id", TAG_U64, request_number)
    if record.tag("node_id") is not None and record.get("node_id") != node:
        raise VerifyError(f"the record's node_id is {record.get('node_id')!r}, not the receipt's node {node}")
    return record, leaf
