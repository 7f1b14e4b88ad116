"""End to end: a tree of 10 canonical records, a signed and cosigned checkpoint, tlog-proof
files, and the CLI's main() on them."""

import io
import os
import subprocess
import sys
import tempfile
import unittest

from custody_verify.cli import main
from custody_verify.notes import ALG_COSIGNATURE_V1, ALG_ED25519
from custody_verify.proofs import ConsistencyProof, TlogProof, format_consistency_proof, format_tlog_proof

from helpers import (
    Signer,
    checkpoint_text,
    consistency_path,
    encode_lost,
    encode_record,
    h_leaf,
    inclusion_path,
    mth,
    sign,
)

ORIGIN = "custody.invalid/audit/node-1/0a0b0c0d"


def make_records(n: int = 10):
    recs = []
    for seq in range(n):
        if seq == 4:
            recs.append(encode_lost(1, seq))
            continue
        recs.append(encode_record("requests", [
            ("node_id", "u32", 1), ("seq", "u64", seq), ("ts_ns", "u64", 1000 + seq),
            ("wall_ns", "i64", -seq), ("request_id", "u64", 77), ("tenant", "utf8", f"tenant-{seq % 3}"),
            ("event", "utf8", "admitted"), ("reason", "null", None), ("prompt_tokens", "u32", 12),
            ("output_tokens", "u32", 0),
        ]))
    return recs


class CliTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.log = Signer(ORIGIN, ALG_ED25519)
        self.w1 = Signer("witness1.example/w", ALG_COSIGNATURE_V1)
        self.w2 = Signer("witness2.example/w", ALG_COSIGNATURE_V1)
        self.records = make_records()
        self.hashes = [h_leaf(r) for r in self.records]

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, data):
        path = os.path.join(self.tmp.name, name)
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        return path

    def checkpoint(self, size, witnesses=()):
        text = checkpoint_text(ORIGIN, size, mth(self.hashes[:size]))
        return sign(text, self.log.line(text), *(w.line(text, 1_700_000_000 + i) for i, w in enumerate(witnesses)))

    def proof_text(self, index, size=10, witnesses=()):
        return format_tlog_proof(TlogProof(index, inclusion_path(index, self.hashes[:size]),
                                           self.checkpoint(size, witnesses), self.records[index]))

    def run_cli(self, *argv):
        out = io.StringIO()
        code = main(list(argv), out)
        return code, out.getvalue()

    def test_every_record(self):
        for index in range(10):
            with self.subTest(index=index):
                path = self.write("p", self.proof_text(index))
                code, out = self.run_cli("proof", path, "--log-key", self.log.vkey)
                self.assertEqual(code, 0, out)
                self.assertTrue(out.startswith(f"OK: record {index} of {ORIGIN} (tree of 10 records, root "
                                               f"{mth(self.hashes).hex()})\n"), out)
        code, out = self.run_cli("proof", self.write("p", self.proof_text(3)), "--log-key", self.log.vkey)
        self.assertIn("table requests:\n  node_id = 1\n  seq = 3\n", out)
        self.assertIn('  tenant = "tenant-0"\n', out)
        self.assertIn("  reason = null\n", out)
        self.assertIn("  wall_ns = -3\n", out)
        code, out = self.run_cli("proof", self.write("p", self.proof_text(4)), "--log-key", self.log.vkey)
        self.assertIn("lost record: node 1, seq 4", out)

    def test_witnesses(self):
        path = self.write("p", self.proof_text(7, witnesses=[self.w1, self.w2]))
        code, out = self.run_cli("proof", path, "--log-key", self.log.vkey,
                                 "--witness-key", self.w1.vkey, "--witness-key", self.w2.vkey)
        self.assertEqual(code, 0, out)
        self.assertIn("cosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)", out)
        self.assertIn("cosigned by witness2.example/w at 2023-11-14T22:13:21Z (1700000001)", out)
        path = self.write("p", self.proof_text(7, witnesses=[self.w1]))
        code, out = self.run_cli("proof", path, "--log-key", self.log.vkey,
                                 "--witness-key", self.w1.vkey, "--witness-key", self.w2.vkey)
        self.assertEqual((code, out), (1, "FAILED: 1 witness cosignature(s) verified, 2 required\n"))
        code, out = self.run_cli("proof", path, "--log-key", self.log.vkey, "--witness-key", self.w1.vkey,
                                 "--witness-key", self.w2.vkey, "--min-witnesses", "1")
        self.assertEqual(code, 0, out)
        code, out = self.run_cli("proof", path, "--log-key", self.log.vkey, "--witness-key", self.log.vkey)
        self.assertEqual(code, 1)
        self.assertIn("not 0x04", out)

    def test_flipped_byte_fails(self):
        text = self.proof_text(6)
        for pos in range(len(text)):
            if text[pos] in "\n ":
                continue
            # Each character of the base64 lines, the index, the note: change it to another one.
            c = text[pos]
            alt = "B" if c != "B" else "C"
            bad = text[:pos] + alt + text[pos + 1:]
            if bad.count("\n") != text.count("\n"):
                continue
            with self.subTest(pos=pos, char=c):
                code, out = self.run_cli("proof", self.write("p", bad), "--log-key", self.log.vkey)
                self.assertEqual(code, 1, out)
                self.assertTrue(out.startswith("FAILED: "), out)

    def test_flipped_record_byte(self):
        proof = TlogProof(6, inclusion_path(6, self.hashes), self.checkpoint(10),
                          self.records[6][:30] + bytes([self.records[6][30] ^ 1]) + self.records[6][31:])
        code, out = self.run_cli("proof", self.write("p", format_tlog_proof(proof)), "--log-key", self.log.vkey)
        self.assertEqual(code, 1)
        self.assertIn("FAILED: inclusion proof does not lead to the root", out)

    def test_other_failures(self):
        other = Signer(ORIGIN, ALG_ED25519)
        code, out = self.run_cli("proof", self.write("p", self.proof_text(1)), "--log-key", other.vkey)
        self.assertEqual((code, out), (1, f"FAILED: checkpoint is not signed by the log key {ORIGIN}\n"))
        no_extra = format_tlog_proof(TlogProof(1, inclusion_path(1, self.hashes), self.checkpoint(10)))
        code, out = self.run_cli("proof", self.write("p", no_extra), "--log-key", self.log.vkey)
        self.assertEqual(code, 1)
        self.assertIn("no extra data", out)
        wrong_index = format_tlog_proof(TlogProof(2, inclusion_path(1, self.hashes), self.checkpoint(10), self.records[1]))
        code, out = self.run_cli("proof", self.write("p", wrong_index), "--log-key", self.log.vkey)
        self.assertEqual(code, 1)
        code, out = self.run_cli("proof", os.path.join(self.tmp.name, "missing"), "--log-key", self.log.vkey)
        self.assertEqual(code, 1)
        self.assertIn("cannot read", out)

    def test_seq_must_be_index(self):
        # A record whose seq column is not its leaf index, but correctly included at that index.
        self.records[2] = self.records[3]
        self.hashes = [h_leaf(r) for r in self.records]
        code, out = self.run_cli("proof", self.write("p", self.proof_text(2)), "--log-key", self.log.vkey)
        self.assertEqual((code, out), (1, "FAILED: the record's seq 3 is not its leaf index 2\n"))

    def test_log_key_file(self):
        key = self.write("key", self.log.vkey + "\n")
        code, out = self.run_cli("proof", self.write("p", self.proof_text(0)), "--log-key-file", key)
        self.assertEqual(code, 0, out)

    def test_consistency(self):
        for old in range(0, 11):
            with self.subTest(old=old):
                old_path = self.write("old", self.checkpoint(old))
                body = format_consistency_proof(ConsistencyProof(old, consistency_path(old, self.hashes),
                                                                 self.checkpoint(10, [self.w1])))
                code, out = self.run_cli("consistency", self.write("c", body), "--old-checkpoint", old_path,
                                         "--log-key", self.log.vkey, "--witness-key", self.w1.vkey)
                self.assertEqual(code, 0, out)
                self.assertTrue(out.startswith(f"OK: the tree of 10 records of {ORIGIN} extends the one of {old}\n"))
        # A fork: the old checkpoint names another root at size 6.
        self.hashes[5] = h_leaf(b"rewritten")
        old_path = self.write("old", self.checkpoint(6))
        self.hashes[5] = h_leaf(self.records[5])
        body = format_consistency_proof(ConsistencyProof(6, consistency_path(6, self.hashes), self.checkpoint(10)))
        code, out = self.run_cli("consistency", self.write("c", body), "--old-checkpoint", old_path,
                                 "--log-key", self.log.vkey)
        self.assertEqual(code, 1)
        self.assertIn("FAILED: consistency proof does not lead to the old root", out)
        # The proof's old size is not the old checkpoint's.
        body = format_consistency_proof(ConsistencyProof(5, consistency_path(6, self.hashes), self.checkpoint(10)))
        code, out = self.run_cli("consistency", self.write("c", body), "--old-checkpoint",
                                 self.write("old", self.checkpoint(6)), "--log-key", self.log.vkey)
        self.assertEqual(code, 1)
        self.assertIn("old checkpoint is of size 6", out)

    def test_record_command(self):
        code, out = self.run_cli("record", self.write("r", self.records[0]))
        self.assertEqual(code, 0)
        self.assertTrue(out.startswith("table requests:\n  node_id = 1\n  seq = 0\n"))
        code, out = self.run_cli("record", self.write("r", self.records[0][:-1]))
        self.assertEqual(code, 1)
        self.assertIn("FAILED: record truncated", out)

    def test_python_dash_m(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = self.write("p", self.proof_text(9))
        run = subprocess.run([sys.executable, "-m", "custody_verify", "proof", path, "--log-key", self.log.vkey],
                             cwd=root, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("OK: record 9 of", run.stdout)
        run = subprocess.run([sys.executable, "-m", "custody_verify", "proof", path], cwd=root,
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 2)


if __name__ == "__main__":
    unittest.main()
