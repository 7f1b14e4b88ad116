"""C2SP signed notes (c2sp.org/signed-note), checkpoints (c2sp.org/tlog-checkpoint) and
Ed25519 cosignatures v1 (c2sp.org/tlog-cosignature).

Key types: 0x01 Ed25519 note signatures (a log's key), 0x04 timestamped Ed25519 cosignatures
(a witness's key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from . import VerifyError

ALG_ED25519 = 0x01
ALG_COSIGNATURE_V1 = 0x04
MAX_NOTE_SIZE = 1_000_000
MAX_SIGNATURES = 100
SIG_PREFIX = "\u2014 "  # em dash, space
MAX_TIMESTAMP = (1 << 63) - 1


def b64decode(text: str, what: str) -> bytes:
    """Standard padded base64 (RFC 4648 section 4), canonical only (no stray padding bits)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise VerifyError(f"{what} is not valid base64: {text!r}") from e
    if base64.b64encode(raw).decode("ascii") != text:
        raise VerifyError(f"{what} is not canonical base64: {text!r}")
    return raw


def valid_key_name(name: str) -> bool:
    """Non-empty, no Unicode whitespace, no '+'."""
    return bool(name) and "+" not in name and not any(c.isspace() for c in name)


def key_id(name: str, alg: int, public_key: bytes) -> int:
    """SHA-256(name || "\\n" || type byte || public key)[:4], big-endian."""
    digest = hashlib.sha256(name.encode("utf-8") + b"\n" + bytes([alg]) + public_key).digest()
    return struct.unpack(">I", digest[:4])[0]


@dataclass(frozen=True)
class VerifierKey:
    """A parsed vkey `<name>+<hex key id>+<base64(type || public key)>`."""

    name: str
    key_id: int
    alg: int
    public_key: bytes

    def __str__(self) -> str:
        raw = base64.b64encode(bytes([self.alg]) + self.public_key).decode()
        return f"{self.name}+{self.key_id:08x}+{raw}"


def parse_vkey(vkey: str) -> VerifierKey:
    """Parse and check a verifier key string (type 0x01 or 0x04, Ed25519)."""
    parts = vkey.strip().split("+", 2)  # the base64 part may itself contain "+"
    if len(parts) != 3:
        raise VerifyError(f"malformed verifier key {vkey!r}: want <name>+<key id>+<key>")
    name, hex_id, b64 = parts
    if not valid_key_name(name):
        raise VerifyError(f"malformed verifier key {vkey!r}: bad key name")
    if not re.fullmatch(r"[0-9a-fA-F]{8}", hex_id):
        raise VerifyError(f"malformed verifier key {vkey!r}: key id is not 8 hex digits")
    raw = b64decode(b64, "verifier key")
    if len(raw) != 33 or raw[0] not in (ALG_ED25519, ALG_COSIGNATURE_V1):
        kind = f"type 0x{raw[0]:02x}, " if raw else ""
        raise VerifyError(f"unsupported verifier key {vkey!r} ({kind}{len(raw)} bytes): "
                          "want type 0x01 or 0x04 and a 32-byte Ed25519 key")
    key = VerifierKey(name, int(hex_id, 16), raw[0], raw[1:])
    if key_id(name, key.alg, key.public_key) != key.key_id:
        raise VerifyError(f"verifier key {vkey!r}: key id does not match the name and key")
    return key


@dataclass(frozen=True)
class NoteSignature:
    name: str
    key_id: int
    signature: bytes  # after the 4-byte key id


@dataclass(frozen=True)
class Note:
    text: str  # ends in "\n"; what the signatures cover
    signatures: List[NoteSignature]


@dataclass(frozen=True)
class VerifiedSignature:
    key: VerifierKey
    timestamp: Optional[int]  # cosignatures only


def parse_note(data: Union[bytes, str]) -> Note:
    """Split a signed note into its text and signature lines (nothing is verified here)."""
    if isinstance(data, bytes):
        if len(data) > MAX_NOTE_SIZE:
            raise VerifyError(f"note is larger than {MAX_NOTE_SIZE} bytes")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise VerifyError(f"note is not valid UTF-8: {e}") from e
    elif len(data.encode("utf-8")) > MAX_NOTE_SIZE:
        raise VerifyError(f"note is larger than {MAX_NOTE_SIZE} bytes")
    for c in data:
        if c < " " and c != "\n":
            raise VerifyError(f"note contains control character {c!r}")
    split = data.rfind("\n\n")
    if split < 0:
        raise VerifyError("note has no empty line before its signatures")
    text, sig_block = data[: split + 1], data[split + 2 :]
    if not sig_block:
        raise VerifyError("note has no signature lines")
    if not sig_block.endswith("\n"):
        raise VerifyError("note's last signature line does not end in a newline")
    lines = sig_block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise VerifyError(f"note has more than {MAX_SIGNATURES} signature lines")
    return Note(text, [_parse_signature_line(line) for line in lines])


def _parse_signature_line(line: str) -> NoteSignature:
    if not line.startswith(SIG_PREFIX):
        raise VerifyError(f"malformed signature line {line!r}: does not start with an em dash and a space")
    name, sep, b64 = line[len(SIG_PREFIX) :].partition(" ")
    if not sep or not valid_key_name(name):
        raise VerifyError(f"malformed signature line {line!r}: bad key name")
    raw = b64decode(b64, f"signature of {name}")
    if len(raw) < 5:
        raise VerifyError(f"malformed signature line {line!r}: too short")
    return NoteSignature(name, struct.unpack(">I", raw[:4])[0], raw[4:])


def _ed25519_ok(public_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False


def cosignature_message(text: str, timestamp: int) -> bytes:
    """What a tlog-cosignature/v1 Ed25519 cosigner signs."""
    return f"cosignature/v1\ntime {timestamp}\n".encode() + text.encode("utf-8")


def _verify_one(key: VerifierKey, text: str, sig: bytes) -> VerifiedSignature:
    if key.alg == ALG_ED25519:
        if len(sig) != 64 or not _ed25519_ok(key.public_key, sig, text.encode("utf-8")):
            raise VerifyError(f"signature by {key.name} ({key.key_id:08x}) does not verify")
        return VerifiedSignature(key, None)
    if len(sig) != 72:
        raise VerifyError(f"cosignature by {key.name} is {len(sig)} bytes, not 8 + 64")
    (timestamp,) = struct.unpack(">Q", sig[:8])
    if timestamp == 0 or timestamp > MAX_TIMESTAMP:
        raise VerifyError(f"cosignature by {key.name} has invalid timestamp {timestamp}")
    if not _ed25519_ok(key.public_key, sig[8:], cosignature_message(text, timestamp)):
        raise VerifyError(f"cosignature by {key.name} ({key.key_id:08x}) at time {timestamp} does not verify")
    return VerifiedSignature(key, timestamp)


def verify_note(note: Note, keys: Iterable[VerifierKey], require_known: bool = True) -> List[VerifiedSignature]:
    """Verify every signature line made by a known key (matching name and key id).

    Lines of unknown keys are ignored. A known key's line that fails makes the whole note
    invalid, and so does (with `require_known`) the absence of any verified signature.
    Returns one entry per known key that signed (repeated lines of a key count once).
    """
    known = {(k.name, k.key_id): k for k in keys}
    verified: dict = {}
    for s in note.signatures:
        key = known.get((s.name, s.key_id))
        if key is None:
            continue
        result = _verify_one(key, note.text, s.signature)
        verified.setdefault((key.name, key.key_id), result)
    if require_known and not verified:
        raise VerifyError("note has no signature from a known key")
    return list(verified.values())


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: List[str]
    text: str


def parse_checkpoint(text: str) -> Checkpoint:
    """Parse a tlog-checkpoint note text (origin, size, base64 root, extension lines)."""
    if not text.endswith("\n"):
        raise VerifyError("checkpoint text does not end in a newline")
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise VerifyError("checkpoint has fewer than 3 lines")
    origin, size_line, root_line, extensions = lines[0], lines[1], lines[2], lines[3:]
    if not origin:
        raise VerifyError("checkpoint origin is empty")
    if not re.fullmatch(r"0|[1-9][0-9]*", size_line) or int(size_line) >= 1 << 64:
        raise VerifyError(f"checkpoint tree size {size_line!r} is not a decimal u64 without leading zeros")
    root = b64decode(root_line, "checkpoint root hash")
    if len(root) != 32:
        raise VerifyError(f"checkpoint root hash is {len(root)} bytes, not 32")
    if any(not e for e in extensions):
        raise VerifyError("checkpoint has an empty extension line")
    return Checkpoint(origin, int(size_line), root, extensions, text)


@dataclass(frozen=True)
class VerifiedCheckpoint:
    checkpoint: Checkpoint
    cosignatures: List[VerifiedSignature]  # witnesses whose cosignature verified


def verify_checkpoint(
    note_data: Union[bytes, str],
    log_key: VerifierKey,
    witness_keys: Sequence[VerifierKey] = (),
    min_witnesses: int = 0,
) -> VerifiedCheckpoint:
    """Check a signed checkpoint: the log's Ed25519 signature (key name = origin), and at
    least `min_witnesses` distinct witnesses' cosignatures."""
    if log_key.alg != ALG_ED25519:
        raise VerifyError(f"log key {log_key.name} is type 0x{log_key.alg:02x}, not 0x01 (Ed25519)")
    for w in witness_keys:
        if w.alg != ALG_COSIGNATURE_V1:
            raise VerifyError(f"witness key {w.name} is type 0x{w.alg:02x}, not 0x04 (Ed25519 cosignature)")
    note = parse_note(note_data)
    checkpoint = parse_checkpoint(note.text)
    if checkpoint.origin != log_key.name:
        raise VerifyError(f"checkpoint origin {checkpoint.origin!r} is not the log key's name {log_key.name!r}")
    verified = verify_note(note, [log_key, *witness_keys], require_known=False)
    if not any(v.key == log_key for v in verified):
        raise VerifyError(f"checkpoint is not signed by the log key {log_key.name}")
    cosigs = [v for v in verified if v.key.alg == ALG_COSIGNATURE_V1]
    distinct = {v.key.public_key for v in cosigs}
    if len(distinct) < min_witnesses:
        raise VerifyError(f"{len(distinct)} witness cosignature(s) verified, {min_witnesses} required")
    return VerifiedCheckpoint(checkpoint, cosigs)
