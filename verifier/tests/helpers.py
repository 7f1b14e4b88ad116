"""Test-only helpers: a hand-written record encoder (from the docs' grammar), an RFC 6962
proof generator, and note signing. None of this is part of the verifier."""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import List, Optional, Sequence, Tuple, Union

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from custody_verify.notes import VerifierKey, key_id

# --- records -------------------------------------------------------------------------------

Col = Tuple[str, str, Optional[Union[int, str]]]  # (name, type, value); type in null/u32/u64/i32/i64/utf8


def encode_record(table: str, columns: Sequence[Col]) -> bytes:
    out = b"custody.audit.record/1\x00"
    t = table.encode()
    out += bytes([len(t)]) + t + struct.pack(">H", len(columns))
    for name, kind, value in columns:
        n = name.encode()
        out += bytes([len(n)]) + n
        if kind == "null":
            out += b"\x00"
        elif kind == "u32":
            out += b"\x01" + struct.pack(">I", value)
        elif kind == "u64":
            out += b"\x02" + struct.pack(">Q", value)
        elif kind == "i32":
            out += b"\x03" + struct.pack(">i", value)
        elif kind == "i64":
            out += b"\x04" + struct.pack(">q", value)
        elif kind == "utf8":
            v = value.encode()
            out += b"\x05" + struct.pack(">I", len(v)) + v
        else:
            raise ValueError(kind)
    return out


def encode_lost(node: int, seq: int) -> bytes:
    return b"custody.audit.lost/1\x00" + struct.pack(">IQ", node, seq)


# --- RFC 6962 tree and proof generation -----------------------------------------------------

def h_leaf(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def h_node(a: bytes, b: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + a + b).digest()


def _split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def mth(hashes: Sequence[bytes]) -> bytes:
    if not hashes:
        return hashlib.sha256(b"").digest()
    if len(hashes) == 1:
        return hashes[0]
    k = _split(len(hashes))
    return h_node(mth(hashes[:k]), mth(hashes[k:]))


def inclusion_path(m: int, hashes: Sequence[bytes]) -> List[bytes]:
    n = len(hashes)
    if n <= 1:
        return []
    k = _split(n)
    if m < k:
        return inclusion_path(m, hashes[:k]) + [mth(hashes[k:])]
    return inclusion_path(m - k, hashes[k:]) + [mth(hashes[:k])]


def _subproof(m: int, hashes: Sequence[bytes], whole: bool) -> List[bytes]:
    n = len(hashes)
    if m == n:
        return [] if whole else [mth(hashes)]
    k = _split(n)
    if m <= k:
        return _subproof(m, hashes[:k], whole) + [mth(hashes[k:])]
    return _subproof(m - k, hashes[k:], False) + [mth(hashes[:k])]


def consistency_path(m: int, hashes: Sequence[bytes]) -> List[bytes]:
    if m == 0 or m == len(hashes):
        return []
    return _subproof(m, hashes, True)


# --- signing ---------------------------------------------------------------------------------

class Signer:
    def __init__(self, name: str, alg: int, private: Optional[Ed25519PrivateKey] = None) -> None:
        self.name, self.alg = name, alg
        self.private = private or Ed25519PrivateKey.generate()
        pub = self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key = VerifierKey(name, key_id(name, alg, pub), alg, pub)
        self.vkey = f"{name}+{self.key.key_id:08x}+" + base64.b64encode(bytes([alg]) + pub).decode()

    def line(self, text: str, timestamp: int = 1_700_000_000) -> str:
        if self.alg == 0x01:
            sig = self.private.sign(text.encode())
        else:
            msg = f"cosignature/v1\ntime {timestamp}\n".encode() + text.encode()
            sig = struct.pack(">Q", timestamp) + self.private.sign(msg)
        raw = struct.pack(">I", self.key.key_id) + sig
        return f"\u2014 {self.name} {base64.b64encode(raw).decode()}\n"


def checkpoint_text(origin: str, size: int, root: bytes) -> str:
    return f"{origin}\n{size}\n{base64.b64encode(root).decode()}\n"


def sign(text: str, *lines: str) -> str:
    return text + "\n" + "".join(lines)
