import base64
import hashlib
import unittest

from custody_verify import VerifyError
from custody_verify.proofs import (
    ConsistencyProof,
    TlogProof,
    format_consistency_proof,
    format_tlog_proof,
    parse_consistency_proof,
    parse_tlog_proof,
)

H1, H2 = hashlib.sha256(b"hash1").digest(), hashlib.sha256(b"hash2").digest()
REF1 = ("c2sp.org/tlog-proof@v1\nindex 5\nrzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=\n"
        "5784L25ZFbP4hhm4ZiI+vx1RxMUyHMzeLp/3AKMlkIY=\n\ntest checkpoint\n")
REF2 = ("c2sp.org/tlog-proof@v1\nextra ZXh0cmEgaW5mb3JtYXRpb24=\nindex 10\n"
        "rzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=\n\ncheckpoint data\n")


class TlogProofTest(unittest.TestCase):
    def test_reference_texts(self):
        p = parse_tlog_proof(REF1.encode())
        self.assertEqual(p, TlogProof(5, [H1, H2], "test checkpoint\n", None))
        self.assertEqual(format_tlog_proof(p), REF1)
        p = parse_tlog_proof(REF2)
        self.assertEqual(p, TlogProof(10, [H1], "checkpoint data\n", b"extra information"))
        self.assertEqual(format_tlog_proof(p), REF2)

    def test_no_hashes(self):
        text = "c2sp.org/tlog-proof@v1\nindex 0\n\ncp\n"
        self.assertEqual(parse_tlog_proof(text), TlogProof(0, [], "cp\n"))
        self.assertEqual(format_tlog_proof(parse_tlog_proof(text)), text)

    def test_max_hashes(self):
        line = base64.b64encode(H1).decode() + "\n"
        ok = "c2sp.org/tlog-proof@v1\nindex 1\n" + line * 63 + "\ncp\n"
        self.assertEqual(len(parse_tlog_proof(ok).proof), 63)
        with self.assertRaisesRegex(VerifyError, "more than 63"):
            parse_tlog_proof(ok.replace("index 1\n", "index 1\n" + line))

    def test_malformed(self):
        for bad in [
            REF1.replace("tlog-proof@v1", "tlog-proof@v2"),
            REF1.replace("index 5", "index 05"),
            REF1.replace("index 5", "index -5"),
            REF1.replace("index 5", "index  5"),
            REF1.replace("index 5\n", ""),
            REF1.replace("\n\ntest", "\ntest"),  # no empty line
            REF1.replace("test checkpoint\n", ""),
            REF1.replace("rzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=", "rzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4"),
            REF1.replace("rzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=", "AAAA"),
            REF2.replace("extra ZXh0", "extra !Xh0"),
            REF1.replace("Cm4=", "Cm5="),  # non-canonical: stray bits in the padding
            REF1.replace("\n", "\r\n"),
            REF2.replace("extra ZXh0cmEgaW5mb3JtYXRpb24=\nindex 10", "index 10\nextra ZXh0cmEgaW5mb3JtYXRpb24="),
        ]:
            with self.subTest(text=bad), self.assertRaises(VerifyError):
                parse_tlog_proof(bad)


class ConsistencyProofTest(unittest.TestCase):
    def test_round_trip(self):
        text = "old 3\nrzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=\n5784L25ZFbP4hhm4ZiI+vx1RxMUyHMzeLp/3AKMlkIY=\n\nnote\n"
        p = parse_consistency_proof(text)
        self.assertEqual(p, ConsistencyProof(3, [H1, H2], "note\n"))
        self.assertEqual(format_consistency_proof(p), text)
        self.assertEqual(parse_consistency_proof("old 0\n\nnote\n"), ConsistencyProof(0, [], "note\n"))

    def test_malformed(self):
        for bad in ["old 03\n\nnote\n", "new 3\n\nnote\n", "old 3\nnote\n", "old 3\nAAAA\n\nnote\n"]:
            with self.subTest(text=bad), self.assertRaises(VerifyError):
                parse_consistency_proof(bad)


if __name__ == "__main__":
    unittest.main()
