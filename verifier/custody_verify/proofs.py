"""The text proof formats, and their verification:

- c2sp.org/tlog-proof@v1 (an inclusion proof with the signed checkpoint; in Custody its
  `extra` is the record's canonical bytes);
- the consistency proof of a c2sp.org/tlog-witness add-checkpoint request body
  (`old <size>`, proof hashes, an empty line, the new signed checkpoint).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from . import VerifyError
from .merkle import leaf_hash, verify_consistency, verify_inclusion
from .notes import (
    VerifiedCheckpoint,
    VerifierKey,
    b64decode,
    verify_checkpoint,
)
from .records import LostRecord, Record, decode_record

TLOG_PROOF_HEADER = "c2sp.org/tlog-proof@v1"
MAX_PROOF_HASHES = 63
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True)
class TlogProof:
    index: int
    proof: List[bytes]
    checkpoint: str  # the signed note, verbatim
    extra: Optional[bytes] = None


@dataclass(frozen=True)
class ConsistencyProof:
    old_size: int
    proof: List[bytes]
    checkpoint: str  # the new signed note, verbatim


def _text(data: Union[bytes, str], what: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise VerifyError(f"{what} is not valid UTF-8: {e}") from e


def _decimal(text: str, what: str) -> int:
    if not _DECIMAL.fullmatch(text) or int(text) >= 1 << 64:
        raise VerifyError(f"{what} {text!r} is not a decimal u64 without leading zeros")
    return int(text)


def _split(data: str, what: str) -> Tuple[List[str], str]:
    """Header lines (all non-empty) before the first empty line, and the note after it."""
    head, sep, note = data.partition("\n\n")
    if not sep:
        raise VerifyError(f"{what} has no empty line before the checkpoint")
    if not note:
        raise VerifyError(f"{what} has no checkpoint after the empty line")
    return head.split("\n"), note


def _hashes(lines: Sequence[str], what: str) -> List[bytes]:
    if len(lines) > MAX_PROOF_HASHES:
        raise VerifyError(f"{what} has {len(lines)} hashes, more than {MAX_PROOF_HASHES}")
    out = []
    for i, line in enumerate(lines):
        h = b64decode(line, f"{what} hash {i}")
        if len(h) != 32:
            raise VerifyError(f"{what} hash {i} is {len(h)} bytes, not 32")
        out.append(h)
    return out


def parse_tlog_proof(data: Union[bytes, str]) -> TlogProof:
    lines, note = _split(_text(data, "proof"), "proof")
    if lines[0] != TLOG_PROOF_HEADER:
        raise VerifyError(f"proof does not start with {TLOG_PROOF_HEADER!r}")
    rest = lines[1:]
    extra = None
    if rest and rest[0].startswith("extra "):
        extra = b64decode(rest[0][len("extra ") :], "proof extra data")
        rest = rest[1:]
    if not rest or not rest[0].startswith("index "):
        raise VerifyError("proof has no 'index <n>' line")
    index = _decimal(rest[0][len("index ") :], "proof index")
    return TlogProof(index, _hashes(rest[1:], "inclusion proof"), note, extra)


def format_tlog_proof(p: TlogProof) -> str:
    lines = [TLOG_PROOF_HEADER]
    if p.extra is not None:
        lines.append("extra " + base64.b64encode(p.extra).decode())
    lines.append(f"index {p.index}")
    lines += [base64.b64encode(h).decode() for h in p.proof]
    return "\n".join(lines) + "\n\n" + p.checkpoint


def parse_consistency_proof(data: Union[bytes, str]) -> ConsistencyProof:
    lines, note = _split(_text(data, "consistency proof"), "consistency proof")
    if not lines[0].startswith("old "):
        raise VerifyError("consistency proof does not start with 'old <size>'")
    old = _decimal(lines[0][len("old ") :], "consistency proof old size")
    return ConsistencyProof(old, _hashes(lines[1:], "consistency proof"), note)


def format_consistency_proof(p: ConsistencyProof) -> str:
    lines = [f"old {p.old_size}"] + [base64.b64encode(h).decode() for h in p.proof]
    return "\n".join(lines) + "\n\n" + p.checkpoint


@dataclass(frozen=True)
class InclusionResult:
    index: int
    verified: VerifiedCheckpoint
    record: Union[Record, LostRecord]


def verify_tlog_proof(
    data: Union[bytes, str],
    log_key: VerifierKey,
    witness_keys: Sequence[VerifierKey] = (),
    min_witnesses: int = 0,
) -> InclusionResult:
    """Check a Custody tlog-proof: the signed checkpoint, the cosignatures, that SHA-256(0x00 ||
    extra) is leaf `index` of the checkpoint's tree, and that `extra` is a Custody record."""
    proof = parse_tlog_proof(data)
    if proof.extra is None:
        raise VerifyError("proof has no extra data (the record's bytes), so its leaf cannot be checked")
    verified = verify_checkpoint(proof.checkpoint.encode("utf-8"), log_key, witness_keys, min_witnesses)
    cp = verified.checkpoint
    verify_inclusion(proof.index, cp.size, leaf_hash(proof.extra), proof.proof, cp.root)
    record = decode_record(proof.extra)
    check_seq(record, proof.index)
    return InclusionResult(proof.index, verified, record)


def check_seq(record: Union[Record, LostRecord], index: int) -> None:
    """A record's seq (a placeholder's too) is its leaf index; decode_record made sure a record
    has a u64 seq column."""
    seq = record.seq if isinstance(record, LostRecord) else record.get("seq")
    if seq != index:
        raise VerifyError(f"the record's seq {seq} is not its leaf index {index}")


@dataclass(frozen=True)
class ConsistencyResult:
    old: VerifiedCheckpoint
    new: VerifiedCheckpoint


def verify_consistency_proof(
    data: Union[bytes, str],
    old_note: Union[bytes, str],
    log_key: VerifierKey,
    witness_keys: Sequence[VerifierKey] = (),
    min_witnesses: int = 0,
) -> ConsistencyResult:
    """Check that the new checkpoint in `data` extends the old one (both signed by the log
    key; cosignatures are required of the new one)."""
    proof = parse_consistency_proof(data)
    old = verify_checkpoint(old_note, log_key)
    new = verify_checkpoint(proof.checkpoint.encode("utf-8"), log_key, witness_keys, min_witnesses)
    if old.checkpoint.origin != new.checkpoint.origin:
        raise VerifyError(f"origins differ: {old.checkpoint.origin!r} and {new.checkpoint.origin!r}")
    if proof.old_size != old.checkpoint.size:
        raise VerifyError(f"proof is from size {proof.old_size}, the old checkpoint is of size {old.checkpoint.size}")
    verify_consistency(old.checkpoint.size, new.checkpoint.size, old.checkpoint.root, new.checkpoint.root, proof.proof)
    return ConsistencyResult(old, new)
