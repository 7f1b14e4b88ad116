"""RFC 6962 / RFC 9162 Merkle tree hashing and proof verification."""

from __future__ import annotations

import hashlib
from typing import Sequence

from . import VerifyError

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    """SHA-256(0x00 || data)."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def root_from_leaf_hashes(hashes: Sequence[bytes]) -> bytes:
    """MTH over already-hashed leaves (RFC 9162 section 2.1.1)."""
    n = len(hashes)
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return hashes[0]
    k = 1 << ((n - 1).bit_length() - 1)  # largest power of two < n
    return node_hash(root_from_leaf_hashes(hashes[:k]), root_from_leaf_hashes(hashes[k:]))


def _check_hash(name: str, value: bytes) -> None:
    if len(value) != HASH_SIZE:
        raise VerifyError(f"{name} is {len(value)} bytes, not {HASH_SIZE}")


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """RFC 9162 section 2.1.3.2: `leaf` (a leaf hash) is entry `index` of the tree `root` of `size`."""
    _check_hash("leaf hash", leaf)
    _check_hash("root hash", root)
    for i, p in enumerate(proof):
        _check_hash(f"inclusion proof hash {i}", p)
    if not 0 <= index < size:
        raise VerifyError(f"index {index} is not in a tree of size {size}")
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise VerifyError("inclusion proof is too long")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerifyError("inclusion proof is too short")
    if r != root:
        raise VerifyError(f"inclusion proof does not lead to the root (computed {r.hex()}, expected {root.hex()})")


def verify_consistency(size1: int, size2: int, root1: bytes, root2: bytes, proof: Sequence[bytes]) -> None:
    """RFC 9162 section 2.1.4.2: the tree `root2` of `size2` extends the tree `root1` of `size1`."""
    _check_hash("old root hash", root1)
    _check_hash("new root hash", root2)
    for i, p in enumerate(proof):
        _check_hash(f"consistency proof hash {i}", p)
    if size1 < 0 or size2 < size1:
        raise VerifyError(f"a tree of size {size2} cannot extend one of size {size1}")
    if size1 == size2:
        if proof:
            raise VerifyError("consistency proof between equal sizes must be empty")
        if root1 != root2:
            raise VerifyError(f"two different roots for the same size {size1}")
        return
    if size1 == 0:
        if proof:
            raise VerifyError("consistency proof from the empty tree must be empty")
        if root1 != EMPTY_ROOT:
            raise VerifyError("the root of the empty tree is not SHA-256 of nothing")
        return
    if not proof:
        raise VerifyError("consistency proof is empty")
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # exact power of two
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise VerifyError("consistency proof is too long")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerifyError("consistency proof is too short")
    if fr != root1:
        raise VerifyError(f"consistency proof does not lead to the old root (computed {fr.hex()}, expected {root1.hex()})")
    if sr != root2:
        raise VerifyError(f"consistency proof does not lead to the new root (computed {sr.hex()}, expected {root2.hex()})")
