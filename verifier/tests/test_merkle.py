import hashlib
import unittest

from custody_verify import VerifyError
from custody_verify.merkle import (
    EMPTY_ROOT,
    leaf_hash,
    node_hash,
    root_from_leaf_hashes,
    verify_consistency,
    verify_inclusion,
)

from helpers import consistency_path, inclusion_path, mth

# transparency-dev/merkle testonly/constants.go
LEAVES = [bytes.fromhex(h) for h in
          ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]]
ROOTS = [bytes.fromhex(h) for h in [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]]


def hx(*hs):
    return [bytes.fromhex(h) for h in hs]


# transparency-dev/merkle proof/verify_test.go (leaf numbers there are 1-based)
INCLUSION = [
    (0, 8, hx("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
              "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
              "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4")),
    (5, 8, hx("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
              "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
              "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7")),
    (2, 3, hx("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125")),
    (1, 2, hx("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d")),
]
CONSISTENCY = [
    (1, 1, []),
    (1, 8, hx("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
              "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
              "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4")),
    (6, 8, hx("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
              "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
              "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7")),
    (2, 5, hx("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
              "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b")),
]


def flip(b: bytes, i: int = 0) -> bytes:
    return b[:i] + bytes([b[i] ^ 1]) + b[i + 1:]


class HashingTest(unittest.TestCase):
    def test_primitives(self):
        self.assertEqual(EMPTY_ROOT, hashlib.sha256(b"").digest())
        self.assertEqual(leaf_hash(b"ab"), hashlib.sha256(b"\x00ab").digest())
        self.assertEqual(node_hash(b"a", b"b"), hashlib.sha256(b"\x01ab").digest())

    def test_roots_0_to_8(self):
        hashes = [leaf_hash(l) for l in LEAVES]
        for n in range(9):
            with self.subTest(size=n):
                self.assertEqual(root_from_leaf_hashes(hashes[:n]), ROOTS[n])

    def test_vectors_agree_with_hashlib(self):
        # The proof vectors' hashes are subtrees of the vector leaves (independent check).
        L = [hashlib.sha256(b"\x00" + l).digest() for l in LEAVES]
        self.assertEqual(INCLUSION[0][2][0], L[1])
        self.assertEqual(INCLUSION[1][2][2], ROOTS[4])
        self.assertEqual(CONSISTENCY[2][2][0], mth(L[4:6]))


class InclusionTest(unittest.TestCase):
    def test_vectors(self):
        for index, size, proof in INCLUSION:
            with self.subTest(index=index, size=size):
                verify_inclusion(index, size, leaf_hash(LEAVES[index]), proof, ROOTS[size])

    def test_size_one_empty_proof(self):
        verify_inclusion(0, 1, leaf_hash(LEAVES[0]), [], ROOTS[1])

    def test_alterations_fail(self):
        for index, size, proof in INCLUSION:
            leaf, root = leaf_hash(LEAVES[index]), ROOTS[size]
            bad = []
            for i in range(len(proof)):
                for byte in (0, 31):
                    bad.append((index, size, leaf, proof[:i] + [flip(proof[i], byte)] + proof[i + 1:], root))
            bad += [
                (index, size, flip(leaf), proof, root),
                (index, size, leaf, proof, flip(root, 7)),
                (index + 1, size, leaf, proof, root),
                (index - 1, size, leaf, proof, root),
                # Another size with that size's root. (With the *same* root a proof can verify
                # for another size of the same shape, e.g. leaf 5 in 7 and in 8: the root, which the
                # checkpoint signs together with its size, is what binds the size.)
                (index, size + 1, leaf, proof, ROOTS[size + 1] if size < 8 else root),
                (index, size - 1, leaf, proof, ROOTS[size - 1]),
                (index, size * 2, leaf, proof, root),
                (index, size, leaf, proof[:-1], root),
                (index, size, leaf, proof + [proof[-1]], root),
                (index, size, leaf, list(reversed(proof)), root) if len(proof) > 1 else (size, size, leaf, proof, root),
                (size, size, leaf, proof, root),
            ]
            for args in bad:
                with self.subTest(args=repr(args)[:120]):
                    with self.assertRaises(VerifyError):
                        verify_inclusion(*args)

    def test_generated_all_sizes(self):
        hashes = [leaf_hash(bytes([i])) for i in range(33)]
        for n in range(1, 34):
            root = mth(hashes[:n])
            for m in range(n):
                proof = inclusion_path(m, hashes[:n])
                verify_inclusion(m, n, hashes[m], proof, root)
                if n > 1:
                    with self.assertRaises(VerifyError):
                        verify_inclusion(m, n, hashes[(m + 1) % n], proof, root)


class ConsistencyTest(unittest.TestCase):
    def test_vectors(self):
        for m, n, proof in CONSISTENCY:
            with self.subTest(old=m, new=n):
                verify_consistency(m, n, ROOTS[m], ROOTS[n], proof)

    def test_alterations_fail(self):
        for m, n, proof in CONSISTENCY:
            bad = [(m, n, ROOTS[m], ROOTS[n], proof[:i] + [flip(proof[i], 5)] + proof[i + 1:]) for i in range(len(proof))]
            bad += [
                (m, n, flip(ROOTS[m]), ROOTS[n], proof),
                (m, n, ROOTS[m], flip(ROOTS[n]), proof),
                (m + 1, n, ROOTS[m], ROOTS[n], proof),
                (m - 1, n, ROOTS[m], ROOTS[n], proof),
                (m, n + 1, ROOTS[m], ROOTS[n + 1] if n < 8 else ROOTS[n], proof),
                (m, n - 1, ROOTS[m], ROOTS[n - 1], proof),
                (m, n * 2, ROOTS[m], ROOTS[n], proof),
                (m, n, ROOTS[m], ROOTS[n], proof + [ROOTS[0]]),
            ]
            if m != n:
                bad.append((n, m, ROOTS[n], ROOTS[m], proof))
            if proof:
                bad.append((m, n, ROOTS[m], ROOTS[n], proof[:-1]))
            for args in bad:
                with self.subTest(args=repr(args)[:120]):
                    with self.assertRaises(VerifyError):
                        verify_consistency(*args)

    def test_edge_cases(self):
        verify_consistency(0, 5, EMPTY_ROOT, ROOTS[5], [])
        verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
        with self.assertRaises(VerifyError):
            verify_consistency(0, 5, EMPTY_ROOT, ROOTS[5], [ROOTS[1]])
        with self.assertRaises(VerifyError):
            verify_consistency(3, 3, ROOTS[3], ROOTS[4], [])
        with self.assertRaises(VerifyError):
            verify_consistency(2, 5, ROOTS[2], ROOTS[5], [])

    def test_generated_all_sizes(self):
        hashes = [leaf_hash(bytes([i])) for i in range(33)]
        for n in range(1, 34):
            for m in range(1, n + 1):
                proof = consistency_path(m, hashes[:n])
                verify_consistency(m, n, mth(hashes[:m]), mth(hashes[:n]), proof)
                if m < n:
                    with self.assertRaises(VerifyError):
                        verify_consistency(m, n, mth(hashes[1:m + 1]), mth(hashes[:n]), proof)


if __name__ == "__main__":
    unittest.main()
