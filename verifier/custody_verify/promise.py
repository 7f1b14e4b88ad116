"""The node's signed promise of a request's records (docs/audit-schema.md, "The promise in the
answer"), made in its answer before anything is sealed: a C2SP signed note under the log's key
(key name = the origin, the key that signs its checkpoints) whose text is, canonical only,

    custody.receipt.promise/1
    <origin>
    <request id>
    <tenant>
    <number of records>
    <seq> <table> <leaf, base64>      one line per record, by strictly increasing seq

The answer carries it in `custody_receipt` (the whole body, beside `usage`, and each choice's
final SSE chunk):

    {"format": "custody-receipt-promise/1", "node": 0, "requests": [
      {"request_id": "req-0-5", "fetch": "/v1/audit/receipt/req-0-5", "origin": "<origin>",
       "records": [{"seq": 812, "table": "requests", "leaf": "<base64>"}, ...],
       "promise": "<signed note>"},
      {"request_id": ..., "fetch": ..., "error": "<why no promise was made>"}]}

Once the request's receipt is sealed, every promised record must be in it with the promised leaf
hash; records of the receipt the promise does not name were written after the answer.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from . import VerifyError
from .notes import ALG_ED25519, VerifierKey, b64decode, parse_checkpoint, parse_note, verify_note
from .receipt import ReceiptRecord, ReceiptResult, _field

PROMISE_HEADER = "custody.receipt.promise/1"
CONTAINER_FORMAT = "custody-receipt-promise/1"
MAX_PROMISE_FILE_SIZE = 64 << 20  # an answer body may hold a long completion
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True)
class PromisedRecord:
    seq: int
    table: str
    leaf: bytes  # SHA-256(0x00 || the record's bytes)

    @property
    def leaf_b64(self) -> str:
        return base64.b64encode(self.leaf).decode("ascii")


@dataclass(frozen=True)
class Promise:
    origin: str
    request_id: str
    tenant: str
    records: List[PromisedRecord]  # by strictly increasing seq
    text: str  # the note text, what the signature covers


@dataclass(frozen=True)
class PromiseEntry:
    """One request of a `custody_receipt` (or a bare note, whose request is in its text)."""

    request_id: Optional[str]  # None for a bare note
    note: Optional[str]  # the signed note; None when the node made no promise
    error: Optional[str]  # why it made none
    origin: Optional[str] = None  # listed beside the note, unsigned
    records: Optional[List[Any]] = None  # listed beside the note, unsigned


# --- the note ----------------------------------------------------------------------------------

def _word(text: str, what: str) -> str:
    if not text or any(c.isspace() or c < " " or c == "\x7f" for c in text):
        raise VerifyError(f"promise {what} {text!r} is not a single word (non-empty, no whitespace)")
    return text


def _decimal(text: str, what: str) -> int:
    if not _DECIMAL.fullmatch(text) or int(text) >= 1 << 64:
        raise VerifyError(f"promise {what} {text!r} is not a decimal u64 without leading zeros")
    return int(text)


def _record_line(line: str, i: int) -> PromisedRecord:
    parts = line.split(" ")
    if len(parts) != 3:
        raise VerifyError(f"promise record line {i} {line!r} is not '<seq> <table> <leaf>' with single spaces")
    seq = _decimal(parts[0], f"record {i} seq")
    table = _word(parts[1], f"record {i} table")
    leaf = b64decode(parts[2], f"promise record {i} leaf")
    if len(leaf) != 32:
        raise VerifyError(f"promise record {i} leaf is {len(leaf)} bytes, not 32")
    return PromisedRecord(seq, table, leaf)


def _not_a_promise(text: str, first: str) -> VerifyError:
    try:
        cp = parse_checkpoint(text)
    except VerifyError:
        return VerifyError(f"not a receipt promise: its first line is {first!r}, not {PROMISE_HEADER!r}")
    return VerifyError(f"not a receipt promise but a checkpoint (of {cp.origin}, {cp.size} records): "
                       f"its first line is not {PROMISE_HEADER!r}")


def parse_promise(text: str) -> Promise:
    """Parse a promise's note text; anything but the canonical form is refused."""
    if not text.endswith("\n"):
        raise VerifyError("promise text does not end in a newline")
    lines = text[:-1].split("\n")
    if lines[0] != PROMISE_HEADER:
        raise _not_a_promise(text, lines[0])
    if len(lines) < 5:
        raise VerifyError(f"promise has {len(lines)} lines, fewer than the 5 before its records")
    origin = _word(lines[1], "origin")
    request_id = _word(lines[2], "request id")
    tenant = _word(lines[3], "tenant")
    count = _decimal(lines[4], "number of records")
    if len(lines) - 5 != count:
        raise VerifyError(f"promise says {count} records but has {len(lines) - 5} record lines")
    records = [_record_line(line, i) for i, line in enumerate(lines[5:])]
    for before, after in zip(records, records[1:]):
        if after.seq <= before.seq:
            raise VerifyError(f"promise records are not by strictly increasing seq ({before.seq}, then {after.seq})")
    return Promise(origin, request_id, tenant, records, text)


def verify_promise(note_data: Union[bytes, str], log_key: VerifierKey) -> Promise:
    """Check a signed promise: canonical, of the log key's origin, signed by the log key."""
    if log_key.alg != ALG_ED25519:
        raise VerifyError(f"log key {log_key.name} is type 0x{log_key.alg:02x}, not 0x01 (Ed25519)")
    try:
        note = parse_note(note_data)
    except VerifyError as e:
        raise VerifyError(f"promise note: {e}") from e
    promise = parse_promise(note.text)
    if promise.origin != log_key.name:
        raise VerifyError(f"promise origin {promise.origin!r} is not the log key's name {log_key.name!r}")
    try:
        verified = verify_note(note, [log_key], require_known=False)
    except VerifyError as e:
        raise VerifyError(f"promise: {e}") from e
    if not verified:
        raise VerifyError(f"promise is not signed by the log key {log_key.name}")
    return promise


# --- where it comes from: the note, or the answer's custody_receipt ----------------------------

def _text(data: Union[bytes, str]) -> str:
    if isinstance(data, str):
        return data
    if len(data) > MAX_PROMISE_FILE_SIZE:
        raise VerifyError(f"promise file is larger than {MAX_PROMISE_FILE_SIZE} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise VerifyError(f"promise file is not valid UTF-8: {e}") from e


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise VerifyError(f"{what} is not valid JSON: {e}") from e


def _entry(obj: Any, i: int) -> PromiseEntry:
    what = f"custody_receipt request {i}"
    if not isinstance(obj, dict):
        raise VerifyError(f"{what} is not a JSON object")
    request_id = _field(obj, "request_id", str, what)
    what = f"{what} ({request_id})"
    if "error" in obj:
        if "promise" in obj:
            raise VerifyError(f"{what} has both an error and a promise")
        return PromiseEntry(request_id, None, _field(obj, "error", str, what))
    note = _field(obj, "promise", str, what)
    origin = _field(obj, "origin", str, what) if "origin" in obj else None
    records = _field(obj, "records", list, what) if "records" in obj else None
    return PromiseEntry(request_id, note, None, origin, records)


def _container(obj: Any) -> List[PromiseEntry]:
    if not isinstance(obj, dict):
        raise VerifyError("custody_receipt is not a JSON object")
    fmt = obj.get("format")
    if fmt != CONTAINER_FORMAT:
        raise VerifyError(f"custody_receipt format is {fmt!r}, not {CONTAINER_FORMAT!r}")
    if "node" in obj:
        _field(obj, "node", int, "custody_receipt")
    return [_entry(r, i) for i, r in enumerate(_field(obj, "requests", list, "custody_receipt"))]


def _from_json(obj: Any) -> List[PromiseEntry]:
    """An answer body or an SSE chunk holding `custody_receipt`, or that object itself."""
    if not isinstance(obj, dict):
        raise VerifyError("promise file is JSON but not an object")
    if "custody_receipt" in obj:
        return _container(obj["custody_receipt"])
    if "format" in obj or "requests" in obj:
        return _container(obj)
    raise VerifyError("promise file is JSON with no custody_receipt: not an answer, a chunk or a custody_receipt")


def _from_sse(text: str) -> List[PromiseEntry]:
    """`data: {chunk}` lines of an SSE stream: the custody_receipt of every chunk that has one."""
    entries: List[PromiseEntry] = []
    found = False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):]
        payload = payload[1:] if payload.startswith(" ") else payload
        if payload.strip() == "[DONE]":
            continue
        chunk = _json(payload, f"SSE line {n}")
        if isinstance(chunk, dict) and "custody_receipt" in chunk:
            found = True
            entries += _container(chunk["custody_receipt"])
    if not found:
        raise VerifyError("no SSE chunk of the promise file has a custody_receipt")
    return entries


def read_promises(data: Union[bytes, str]) -> List[PromiseEntry]:
    """What a promise file holds: the note itself, or JSON (an answer body, an SSE chunk, or a
    `custody_receipt` object), or `data:` lines of an SSE stream."""
    text = _text(data)
    head = text.lstrip()
    if head.startswith(("{", "[")):
        return _from_json(_json(text, "promise file"))
    if head.startswith("data:"):
        return _from_sse(text)
    return [PromiseEntry(None, text, None)]


def select_promises(entries: List[PromiseEntry], request_id: Optional[str] = None) -> List[PromiseEntry]:
    """The entries of `request_id` (a bare note is kept: its request is checked once it is
    verified), or all; the same entry repeated (several chunks of one answer) counts once."""
    chosen = [e for e in entries if request_id is None or e.request_id in (None, request_id)]
    if not chosen:
        named = ", ".join(sorted({e.request_id for e in entries if e.request_id is not None})) or "none"
        raise VerifyError(f"the answer holds no promise of request {request_id} (it names: {named})")
    distinct: List[PromiseEntry] = []
    for e in chosen:
        if e not in distinct:
            distinct.append(e)
    ids = [e.request_id for e in distinct]
    for rid in ids:
        if ids.count(rid) > 1:
            raise VerifyError(f"the answer holds {ids.count(rid)} different entries of request {rid}")
    return distinct


def _check_listed(entry: PromiseEntry, promise: Promise) -> None:
    """What custody_receipt lists beside the note (unsigned) must be what the note says."""
    rid = promise.request_id
    if entry.request_id is not None and entry.request_id != rid:
        raise VerifyError(f"custody_receipt lists request {entry.request_id!r} for a promise of {rid!r}")
    if entry.origin is not None and entry.origin != promise.origin:
        raise VerifyError(f"custody_receipt lists origin {entry.origin!r} for a promise of {promise.origin!r}")
    if entry.records is None:
        return
    listed = []
    for i, r in enumerate(entry.records):
        what = f"custody_receipt record {i} of {rid}"
        if not isinstance(r, dict):
            raise VerifyError(f"{what} is not a JSON object")
        listed.append((_field(r, "seq", int, what), _field(r, "table", str, what), _field(r, "leaf", str, what)))
    if listed != [(r.seq, r.table, r.leaf_b64) for r in promise.records]:
        raise VerifyError(f"custody_receipt lists other records of {rid} than its signed promise names")


def verify_entry(entry: PromiseEntry, log_key: VerifierKey) -> Promise:
    """Verify one entry's signed promise (an entry with an error is refused, naming it)."""
    if entry.note is None:
        raise VerifyError(f"the node made no promise of {entry.request_id} in its answer: {entry.error}")
    promise = verify_promise(entry.note, log_key)
    _check_listed(entry, promise)
    return promise


# --- the promise kept: the receipt ----------------------------------------------------------------

@dataclass(frozen=True)
class PromiseCheck:
    promise: Promise
    after: List[ReceiptRecord]  # records of the receipt the promise does not name


def _check_kept(p: PromisedRecord, have: Optional[ReceiptRecord], request_id: str, tree_size: int) -> None:
    head = f"the node promised record {p.seq} ({p.table}) of {request_id} in its answer"
    if have is None:
        if p.seq >= tree_size:
            raise VerifyError(f"{head} but the receipt lacks it: the receipt's tree of {tree_size} records ends "
                              "before it (a receipt of a later checkpoint must hold it, or the log lost it)")
        raise VerifyError(f"{head} but the receipt lacks it: the log lost or rewrote it")
    if have.leaf != p.leaf:
        got = base64.b64encode(have.leaf).decode("ascii")
        raise VerifyError(f"{head} but the receipt has another record there ({have.record.table}, leaf {got} "
                          f"instead of {p.leaf_b64}): the log lost or rewrote it")
    if have.record.table != p.table:
        raise VerifyError(f"{head}, but the record with its leaf is of table {have.record.table}")


def check_promise(promise: Promise, receipt: ReceiptResult) -> PromiseCheck:
    """Hold a verified receipt to a verified promise: the same log, request and tenant, and every
    promised seq in the receipt with the promised leaf."""
    cp = receipt.verified.checkpoint
    if promise.origin != cp.origin:
        raise VerifyError(f"the promise is of log {promise.origin!r}, the receipt of {cp.origin!r}")
    if promise.request_id != receipt.request_id:
        raise VerifyError(f"the promise is of request {promise.request_id!r}, not the receipt's {receipt.request_id!r}")
    if promise.tenant != receipt.tenant:
        raise VerifyError(f"the promise is of tenant {promise.tenant!r}, not the receipt's {receipt.tenant!r}")
    by_seq: Dict[int, ReceiptRecord] = {r.seq: r for r in receipt.records}
    for p in promise.records:
        _check_kept(p, by_seq.get(p.seq), promise.request_id, cp.size)
    promised = {p.seq for p in promise.records}
    return PromiseCheck(promise, [r for r in receipt.records if r.seq not in promised])


def verify_receipt_promise(data: Union[bytes, str], log_key: VerifierKey, receipt: ReceiptResult) -> PromiseCheck:
    """The promise of the receipt's request in a promise file, verified and held to the receipt."""
    (entry,) = select_promises(read_promises(data), receipt.request_id)
    return check_promise(verify_entry(entry, log_key), receipt)
