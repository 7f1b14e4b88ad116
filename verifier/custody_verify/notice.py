"""Per-tenant incident notices (`custody-notice/1`, docs/forensics.md, "Notices"): a tenant's
signed statement of what, in a window, its requests could have read of other tenants' requests
(`as_recipient`) and what other tenants' responses could have read of its own (`as_source`) —
or, with both lists empty and `exposed: false`, of non-exposure — each listed request with the
receipt of its own records, and per node the tree sealed by the window's start linked to the
node's checkpoint now by a consistency proof:

    {"format": "custody-notice/1", "tenant": "acme", "issued_wall_ns": 0,
     "window": {"from_wall_ns": 0, "to_wall_ns": 0}, "exposed": true, "summary": "...",
     "as_recipient": [{"node": 2, "request_id": "req-2-4", "foreign_slots": 207,
       "first_wall_ns": 0, "last_wall_ns": 0, "unchecked": true, "source_requests": 2,
       "receipt": {"format": "custody-receipt/1", ...}}],
     "as_source": [{"node": 2, "request_id": "req-2-1", ..., "responses": 1,
       "receipt_missing": "<why>"}],
     "truncated": false,
     "logs": [{"node": 1, "origin": "...", "old_size": 0, "old_root": null, "tree_size": 202,
       "consistency": "old 0\\n<proof hashes>\\n\\n<signed checkpoint note>"}]}

Its signature (`<tenant>.notice.sig`) is a signed note by the notice key (the operator's, not a
node's) whose text is exactly

    custody.notice/1
    <tenant>
    <base64 SHA-256 of the notice file's bytes>
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from . import VerifyError
from .merkle import EMPTY_ROOT, verify_consistency
from .notes import ALG_ED25519, VerifiedCheckpoint, VerifierKey, b64decode, parse_note, verify_checkpoint, verify_note
from .proofs import parse_consistency_proof
from .receipt import ReceiptResult, _field, verify_receipt_object

NOTICE_FORMAT = "custody-notice/1"
NOTICE_HEADER = "custody.notice/1"
MAX_NOTICE_SIZE = 1 << 30
SIDES = ("as_recipient", "as_source")
# Counts and times an entry may carry (each checked only when present); `node` and `request_id`
# are required.
_ENTRY_U64 = ("foreign_slots", "source_requests", "responses")
_ENTRY_I64 = ("first_wall_ns", "last_wall_ns")


@dataclass(frozen=True)
class NoticeEntry:
    side: str  # "as_recipient" or "as_source"
    index: int
    node: int
    request_id: str
    receipt: Optional[ReceiptResult]  # verified; None when missing
    missing: Optional[str]  # the notice's `receipt_missing`


@dataclass(frozen=True)
class NoticeLog:
    node: int
    origin: str
    old_size: int
    tree_size: int
    verified: VerifiedCheckpoint


@dataclass(frozen=True)
class NoticeResult:
    tenant: str
    exposed: bool
    summary: Optional[str]
    window: Optional[Dict[str, Any]]
    truncated: bool
    entries: List[NoticeEntry]
    logs: List[NoticeLog]


def default_sig_path(notice_path: str) -> str:
    """`X.notice.json` -> `X.notice.sig` (a path not ending in `.json` gets `.sig` appended)."""
    return (notice_path[: -len(".json")] if notice_path.endswith(".json") else notice_path) + ".sig"


def log_key_map(keys: Sequence[VerifierKey]) -> Dict[str, VerifierKey]:
    """The log keys by name (= the origin whose checkpoints each signs); one per origin."""
    out: Dict[str, VerifierKey] = {}
    for k in keys:
        if k.alg != ALG_ED25519:
            raise VerifyError(f"log key {k.name} is type 0x{k.alg:02x}, not 0x01 (Ed25519)")
        if k.name in out and out[k.name] != k:
            raise VerifyError(f"two different log keys are named {k.name!r}")
        out[k.name] = k
    return out


def _key_for(keys: Dict[str, VerifierKey], origin: str, whose: str) -> VerifierKey:
    key = keys.get(origin)
    if key is None:
        raise VerifyError(f"no --log-key named {origin!r} ({whose})")
    return key


def verify_notice_signature(data: bytes, sig: Union[bytes, str], notice_key: VerifierKey) -> str:
    """Check the signed note over the notice file's bytes; returns the tenant it names."""
    if notice_key.alg != ALG_ED25519:
        raise VerifyError(f"notice key {notice_key.name} is type 0x{notice_key.alg:02x}, not 0x01 (Ed25519)")
    try:
        note = parse_note(sig)
        verified = verify_note(note, [notice_key], require_known=False)
    except VerifyError as e:
        raise VerifyError(f"notice signature: {e}") from e
    if not verified:
        raise VerifyError(f"the notice signature is not signed by the notice key {notice_key.name} "
                          f"({notice_key.key_id:08x})")
    lines = note.text[:-1].split("\n")  # parse_note: the text ends in a newline
    if len(lines) != 3 or lines[0] != NOTICE_HEADER:
        raise VerifyError(f"the notice signature's text is not {NOTICE_HEADER!r}, a tenant and a hash: "
                          f"{note.text!r}")
    signed = b64decode(lines[2], "the notice signature's hash")
    if len(signed) != 32:
        raise VerifyError(f"the notice signature's hash is {len(signed)} bytes, not 32")
    actual = hashlib.sha256(data).digest()
    if signed != actual:
        raise VerifyError(f"the notice signature is over other bytes: it signs SHA-256 {lines[2]}, "
                          f"the notice file's is {base64.b64encode(actual).decode()}")
    return lines[1]


def _parse(data: bytes) -> Dict[str, Any]:
    if len(data) > MAX_NOTICE_SIZE:
        raise VerifyError(f"notice is larger than {MAX_NOTICE_SIZE} bytes")
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise VerifyError(f"notice is not valid UTF-8: {e}") from e
    except (json.JSONDecodeError, RecursionError) as e:
        raise VerifyError(f"notice is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise VerifyError("notice is not a JSON object")
    return obj


def _optional_int(obj: Dict[str, Any], name: str, what: str, unsigned: bool) -> None:
    if obj.get(name) is None:
        return
    if unsigned:
        _field(obj, name, int, what)
        return
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or not -(1 << 63) <= value < 1 << 63:
        raise VerifyError(f"{what}'s {name!r} is not an i64: {value!r}")


def verify_notice(
    data: bytes,
    sig: Union[bytes, str],
    notice_key: VerifierKey,
    log_keys: Sequence[VerifierKey],
    witness_keys: Sequence[VerifierKey] = (),
    min_witnesses: int = 0,
) -> NoticeResult:
    """Check a notice: its signature (notice key, these bytes, this tenant); `exposed` true exactly
    when a request is listed; every embedded receipt (as `custody-verify receipt` does, under the
    log key named by its origin, of the notice's tenant and the entry's request); and every log's
    checkpoint (log key named `origin`, cosignatures) and consistency proof from the tree at the
    window's start."""
    keys = log_key_map(log_keys)
    signed_tenant = verify_notice_signature(data, sig, notice_key)
    obj = _parse(data)
    fmt = obj.get("format")
    if fmt != NOTICE_FORMAT:
        raise VerifyError(f"notice format is {fmt!r}, not {NOTICE_FORMAT!r}")
    tenant = _field(obj, "tenant", str, "notice")
    if signed_tenant != tenant:
        raise VerifyError(f"the notice signature is of tenant {signed_tenant!r}, the notice of {tenant!r}")
    exposed = _field(obj, "exposed", bool, "notice")
    sides = {side: _field(obj, side, list, "notice") for side in SIDES}
    listed = sum(len(v) for v in sides.values())
    if exposed and not listed:
        raise VerifyError("the notice says exposed: true but lists no request")
    if not exposed and listed:
        raise VerifyError(f"the notice says exposed: false but lists {listed} request(s)")
    summary = _field(obj, "summary", str, "notice") if obj.get("summary") is not None else None
    truncated = _field(obj, "truncated", bool, "notice") if obj.get("truncated") is not None else False
    window = None
    if obj.get("window") is not None:
        window = _field(obj, "window", dict, "notice")
        for name in ("from_wall_ns", "to_wall_ns"):
            _optional_int(window, name, "notice window", unsigned=False)
    _optional_int(obj, "issued_wall_ns", "notice", unsigned=False)

    logs = [_verify_log(entry, i, keys, witness_keys, min_witnesses)
            for i, entry in enumerate(_field(obj, "logs", list, "notice"))]
    entries = [_verify_entry(entry, side, i, tenant, keys, witness_keys, min_witnesses)
               for side in SIDES for i, entry in enumerate(sides[side])]
    return NoticeResult(tenant, exposed, summary, window, truncated, entries, logs)


def _verify_entry(entry: Any, side: str, index: int, tenant: str, keys: Dict[str, VerifierKey],
                  witness_keys: Sequence[VerifierKey], min_witnesses: int) -> NoticeEntry:
    what = f"{side}[{index}]"
    if not isinstance(entry, dict):
        raise VerifyError(f"{what} is not a JSON object")
    node = _field(entry, "node", int, what)
    request_id = _field(entry, "request_id", str, what)
    for name in _ENTRY_U64:
        _optional_int(entry, name, what, unsigned=True)
    for name in _ENTRY_I64:
        _optional_int(entry, name, what, unsigned=False)
    if entry.get("unchecked") is not None:
        _field(entry, "unchecked", bool, what)
    what = f"{side}[{index}] ({request_id} on node {node})"
    receipt, missing = entry.get("receipt"), entry.get("receipt_missing")
    if receipt is not None and missing is not None:
        raise VerifyError(f"{what} has both a receipt and receipt_missing")
    if missing is not None:
        return NoticeEntry(side, index, node, request_id, None, _field(entry, "receipt_missing", str, what))
    if receipt is None:
        raise VerifyError(f"{what} has neither a receipt nor receipt_missing")
    try:
        if not isinstance(receipt, dict):
            raise VerifyError("the receipt is not a JSON object")
        origin = _field(receipt, "origin", str)
        result = verify_receipt_object(receipt, _key_for(keys, origin, "the receipt's origin"),
                                       witness_keys, min_witnesses)
        if result.tenant != tenant:
            raise VerifyError(f"the receipt is of tenant {result.tenant!r}, not the notice's {tenant!r}")
        if result.request_id != request_id:
            raise VerifyError(f"the receipt is of request {result.request_id!r}, not the entry's {request_id!r}")
        if result.node != node:
            raise VerifyError(f"the receipt is of node {result.node}, not the entry's {node}")
    except VerifyError as e:
        raise VerifyError(f"{what}: {e}") from e
    return NoticeEntry(side, index, node, request_id, result, None)


def _verify_log(entry: Any, index: int, keys: Dict[str, VerifierKey],
                witness_keys: Sequence[VerifierKey], min_witnesses: int) -> NoticeLog:
    what = f"logs[{index}]"
    if not isinstance(entry, dict):
        raise VerifyError(f"{what} is not a JSON object")
    node = _field(entry, "node", int, what)
    origin = _field(entry, "origin", str, what)
    old_size = _field(entry, "old_size", int, what)
    tree_size = _field(entry, "tree_size", int, what)
    body = _field(entry, "consistency", str, what)
    old_root_b64 = _field(entry, "old_root", str, what) if entry.get("old_root") is not None else None
    what = f"the log of node {node} ({origin})"
    try:
        key = _key_for(keys, origin, f"the log of node {node}")
        if old_size > tree_size:
            raise VerifyError(f"old_size {old_size} is larger than tree_size {tree_size}")
        old_root = None
        if old_root_b64 is not None:
            old_root = b64decode(old_root_b64, "old_root")
            if len(old_root) != 32:
                raise VerifyError(f"old_root is {len(old_root)} bytes, not 32")
        proof = parse_consistency_proof(body)
        if proof.old_size != old_size:
            raise VerifyError(f"the consistency proof is from size {proof.old_size}, not old_size {old_size}")
        verified = verify_checkpoint(proof.checkpoint.encode("utf-8"), key, witness_keys, min_witnesses)
        cp = verified.checkpoint
        if cp.size != tree_size:
            raise VerifyError(f"tree_size {tree_size} is not the checkpoint's size {cp.size}")
        if 0 < old_size < tree_size:
            if old_root is None:
                raise VerifyError(f"old_root is null, but old_size is {old_size}")
            verify_consistency(old_size, tree_size, old_root, cp.root, proof.proof)
        else:
            if proof.proof:
                raise VerifyError(f"the consistency proof from size {old_size} to {tree_size} must have no hashes, "
                                  f"it has {len(proof.proof)}")
            if old_size == 0 and old_root is not None and old_root != EMPTY_ROOT:
                raise VerifyError("old_root is not the empty tree's root, but old_size is 0")
            if old_size == tree_size and old_size > 0 and old_root is not None and old_root != cp.root:
                raise VerifyError(f"old_root is not the checkpoint's root, at the same size {old_size}")
    except VerifyError as e:
        raise VerifyError(f"{what}: {e}") from e
    return NoticeLog(node, origin, old_size, tree_size, verified)
