"""Receipts (custody-receipt/1): a tree of canonical records of two requests of two tenants, a
signed and cosigned checkpoint, a receipt of one request's records, and main() on it."""

import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

from custody_verify.cli import main
from custody_verify.notes import ALG_COSIGNATURE_V1, ALG_ED25519
from custody_verify.proofs import TlogProof, format_tlog_proof

from helpers import Signer, checkpoint_text, encode_lost, encode_record, h_leaf, inclusion_path, mth, sign

NODE = 5
ORIGIN = "custody.invalid/audit/node-5/01020304"


def common(seq):
    return [("node_id", "u32", NODE), ("seq", "u64", seq), ("ts_ns", "u64", 1000 + seq),
            ("wall_ns", "i64", 1_700_000_000_000_000_000 + seq)]


def request(seq, rid, tenant, event, reason=None, out_tokens=0):
    return encode_record("requests", common(seq) + [
        ("request_id", "u64", rid), ("tenant", "utf8", tenant), ("event", "utf8", event),
        ("reason", "utf8" if reason is not None else "null", reason), ("prompt_tokens", "u32", 12),
        ("output_tokens", "u32", out_tokens)])


def page_event(seq, rid, tenant, event, page):
    return encode_record("page_events", common(seq) + [
        ("request_id", "u64", rid), ("tenant", "utf8", tenant), ("event", "utf8", event),
        ("page", "u32", page), ("generation", "u32", 1)])


def page_read(seq, rid, tenant, page):
    return encode_record("page_reads", common(seq) + [
        ("request_id", "u64", rid), ("tenant", "utf8", tenant), ("page", "u32", page), ("generation", "u32", 1),
        ("first_step", "u64", 3), ("last_step", "u64", 9), ("verdict", "utf8", "verified")])


# Request 12 of tenant acme: seqs 1, 3, 6, 7, 9; request 13 of tenant globex: seqs 2, 5, 8.
RECORDS = [
    encode_record("writer_events", common(0) + [("event", "utf8", "started"), ("detail", "null", None)]),
    request(1, 12, "acme", "admitted"),
    request(2, 13, "globex", "admitted"),
    page_event(3, 12, "acme", "alloc", 40),
    encode_lost(NODE, 4),
    page_event(5, 13, "globex", "alloc", 41),
    page_read(6, 12, "acme", 40),
    request(7, 12, "acme", "finished", "stop", 7),
    request(8, 13, "globex", "finished", "length", 16),
    page_event(9, 12, "acme", "release", 40),
    encode_record("writer_events", common(10) + [("event", "utf8", "sealed"), ("detail", "utf8", "x")]),
]
TABLES = {1: "requests", 2: "requests", 3: "page_events", 4: "requests", 5: "page_events", 6: "page_reads",
          7: "requests", 8: "requests", 9: "page_events", 10: "writer_events"}
ACME = [1, 3, 6, 7, 9]
GLOBEX = [2, 5, 8]


class ReceiptFixture:
    """The tree, a signed checkpoint, receipts of it, and main() on them (no tests of its own)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.log = Signer(ORIGIN, ALG_ED25519)
        self.w1 = Signer("witness1.example/w", ALG_COSIGNATURE_V1)
        self.hashes = [h_leaf(r) for r in RECORDS]

    def tearDown(self):
        self.tmp.cleanup()

    def checkpoint(self, size=len(RECORDS), witnesses=None):
        witnesses = [self.w1] if witnesses is None else witnesses
        text = checkpoint_text(ORIGIN, size, mth(self.hashes[:size]))
        return sign(text, self.log.line(text), *(w.line(text, 1_700_000_000 + i) for i, w in enumerate(witnesses)))

    def entry(self, seq, checkpoint, size=len(RECORDS), extra=None, index=None):
        extra = RECORDS[seq] if extra is None else extra
        index = seq if index is None else index
        proof = TlogProof(index, inclusion_path(seq, self.hashes[:size]), checkpoint, extra)
        return {"table": TABLES[seq], "seq": seq, "proof": format_tlog_proof(proof)}

    def receipt(self, seqs=ACME, request_id="req-5-12", tenant="acme", witnesses=None):
        cp = self.checkpoint(witnesses=witnesses)
        return {"format": "custody-receipt/1", "node": NODE, "request_id": request_id, "tenant": tenant,
                "origin": ORIGIN, "tree_size": len(RECORDS), "checkpoint": cp,
                "records": [self.entry(s, cp) for s in seqs]}

    def write(self, data, name="receipt.json"):
        path = os.path.join(self.tmp.name, name)
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else
                    (data if isinstance(data, str) else json.dumps(data, indent=1)).encode())
        return path

    def run_cli(self, receipt, *extra_args):
        out = io.StringIO()
        code = main(["receipt", self.write(receipt), "--log-key", self.log.vkey, *extra_args], out)
        return code, out.getvalue()

    def assert_fails(self, receipt, message, *extra_args):
        code, out = self.run_cli(receipt, *extra_args)
        self.assertEqual(code, 1, out)
        self.assertTrue(out.startswith("FAILED: "), out)
        self.assertIn(message, out)
        self.assertEqual(out.count("\n"), 1, out)


class ReceiptTest(ReceiptFixture, unittest.TestCase):
    # --- success ---------------------------------------------------------------------------

    def test_ok(self):
        code, out = self.run_cli(self.receipt(), "--witness-key", self.w1.vkey)
        self.assertEqual(code, 0, out)
        wall = 1_700_000_000_000_000_000
        self.assertEqual(out, "\n".join([
            f"OK: req-5-12 of tenant acme: 5 records in the tree of 11 records of {ORIGIN}",
            "cosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)",
            f'  seq 1 requests: wall_ns={wall + 1} request_id=12 tenant="acme" event="admitted" reason=null '
            "prompt_tokens=12 output_tokens=0",
            f'  seq 3 page_events: wall_ns={wall + 3} request_id=12 tenant="acme" event="alloc" page=40 generation=1',
            f'  seq 6 page_reads: wall_ns={wall + 6} request_id=12 tenant="acme" page=40 generation=1 first_step=3 '
            'last_step=9 verdict="verified"',
            f'  seq 7 requests: wall_ns={wall + 7} request_id=12 tenant="acme" event="finished" reason="stop" '
            "prompt_tokens=12 output_tokens=7",
            f'  seq 9 page_events: wall_ns={wall + 9} request_id=12 tenant="acme" event="release" page=40 '
            "generation=1",
        ]) + "\n")

    def test_ok_other_tenant_and_options(self):
        receipt = self.receipt(GLOBEX, "req-5-13", "globex")
        code, out = self.run_cli(receipt)  # no witness key given: an unknown cosignature is neither checked nor listed
        self.assertEqual(code, 0, out)
        self.assertTrue(out.startswith(f"OK: req-5-13 of tenant globex: 3 records in the tree of 11 records of "
                                       f"{ORIGIN}\n  seq 2 requests: "), out)
        code, out = self.run_cli(receipt, "--witness-key", self.w1.vkey, "--min-witnesses", "1")
        self.assertEqual(code, 0, out)
        self.assertIn("\ncosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)\n  seq 2 ", out)
        # Only the requests row is enough; --log-key-file works too.
        key = self.write(self.log.vkey + "\n", "key")
        out = io.StringIO()
        code = main(["receipt", self.write(self.receipt([7])), "--log-key-file", key], out)
        self.assertEqual(code, 0, out.getvalue())
        self.assertIn(": 1 records in the tree", out.getvalue())

    def test_python_dash_m(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = self.write(self.receipt())
        run = subprocess.run([sys.executable, "-m", "custody_verify", "receipt", path, "--log-key", self.log.vkey],
                             cwd=root, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertTrue(run.stdout.startswith("OK: req-5-12 of tenant acme: 5 records"), run.stdout)
        run = subprocess.run([sys.executable, "-m", "custody_verify", "receipt", path], cwd=root,
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 2)

    # --- the failures the receipt must catch -----------------------------------------------

    def test_record_of_another_tenant(self):
        receipt = self.receipt([1, 2, 3])
        self.assert_fails(receipt, "FAILED: record 1 (requests seq 2): the record's tenant is 'globex', "
                                   "not the receipt's 'acme'")
        # Each of globex's records, in acme's receipt, at any place.
        for seq in GLOBEX:
            for at in (0, 2, 5):
                with self.subTest(seq=seq, at=at):
                    receipt = self.receipt()
                    receipt["records"].insert(at, self.entry(seq, receipt["checkpoint"]))
                    self.assert_fails(receipt, "tenant is 'globex', not the receipt's 'acme'")

    def test_record_of_another_request(self):
        self.assert_fails(self.receipt(request_id="req-5-13"),
                          "FAILED: record 0 (requests seq 1): the record's request_id is 12, not the receipt's 13")
        self.assert_fails(self.receipt(request_id="req-5"), "the record's request_id is 12, not the receipt's 5")

    def test_proof_to_another_checkpoint(self):
        # A valid proof of the same record, but to an older checkpoint (size 10).
        receipt = self.receipt()
        receipt["records"][2] = self.entry(6, self.checkpoint(10), size=10)
        self.assert_fails(receipt, "FAILED: record 2 (page_reads seq 6): its proof's checkpoint is not the "
                                   "receipt's checkpoint")
        # The same tree, but a note that differs (no cosignature): not byte-identical either.
        receipt = self.receipt()
        receipt["records"][0] = self.entry(1, self.checkpoint(witnesses=[]))
        self.assert_fails(receipt, "record 0 (requests seq 1): its proof's checkpoint is not the receipt's")

    def test_altered_extra_byte(self):
        for pos in (30, len(RECORDS[3]) - 1):
            with self.subTest(pos=pos):
                receipt = self.receipt()
                bad = bytearray(RECORDS[3])
                bad[pos] ^= 1
                receipt["records"][1] = self.entry(3, receipt["checkpoint"], extra=bytes(bad))
                self.assert_fails(receipt, "FAILED: record 1 (page_events seq 3): inclusion proof does not lead "
                                           "to the root")
        # A record rewritten to another tenant (so its own columns would pass) fails the same way.
        receipt = self.receipt(GLOBEX, "req-5-13", "globex")
        receipt["records"][0] = self.entry(2, receipt["checkpoint"], extra=request(2, 13, "globex", "rejected"))
        self.assert_fails(receipt, "inclusion proof does not lead to the root")

    def test_wrong_tree_size(self):
        for size in (10, 12, 0):
            with self.subTest(size=size):
                receipt = self.receipt()
                receipt["tree_size"] = size
                self.assert_fails(receipt, f"FAILED: receipt tree_size {size} is not the checkpoint's size 11")

    def test_missing_cosignature(self):
        receipt = self.receipt(witnesses=[])
        self.assert_fails(receipt, "FAILED: 0 witness cosignature(s) verified, 1 required",
                          "--witness-key", self.w1.vkey, "--min-witnesses", "1")
        self.assert_fails(receipt, "FAILED: 0 witness cosignature(s) verified, 1 required",
                          "--witness-key", self.w1.vkey)
        code, out = self.run_cli(receipt, "--witness-key", self.w1.vkey, "--min-witnesses", "0")
        self.assertEqual(code, 0, out)
        # A cosignature by another witness than the one asked for does not count.
        other = Signer("witness1.example/w", ALG_COSIGNATURE_V1)
        self.assert_fails(self.receipt(witnesses=[other]), "0 witness cosignature(s) verified, 1 required",
                          "--witness-key", self.w1.vkey, "--min-witnesses", "1")

    def test_no_requests_record(self):
        self.assert_fails(self.receipt([3, 6, 9]), "FAILED: receipt has no record of table requests")
        self.assert_fails(self.receipt([]), "FAILED: receipt has no records")

    def test_lost_placeholder(self):
        receipt = self.receipt()
        receipt["records"].insert(1, self.entry(4, receipt["checkpoint"]))
        self.assert_fails(receipt, "FAILED: record 1 (requests seq 4): it is the placeholder of a lost record "
                                   "(node 5, seq 4), not a record")

    # --- the other checks ------------------------------------------------------------------

    def test_header_failures(self):
        cases = [
            ("format", "custody-receipt/2", "receipt format is 'custody-receipt/2', not 'custody-receipt/1'"),
            ("format", None, "receipt format is None"),
            ("origin", "custody.invalid/audit/node-6/01020304", "receipt origin 'custody.invalid/audit/node-6/"
                                                                "01020304' is not the checkpoint's origin"),
            ("tree_size", "11", "receipt's 'tree_size' is not an integer"),
            ("tree_size", True, "receipt's 'tree_size' is not an integer"),
            ("node", -1, "receipt's 'node' -1 is not a u64"),
            ("tenant", 7, "receipt's 'tenant' is not a string"),
            ("request_id", "req-5-x", "request_id 'req-5-x' does not end in '-<number>'"),
            ("request_id", "12", "request_id '12' does not end in '-<number>'"),
            ("records", {}, "receipt's 'records' is not a list"),
            ("checkpoint", "not a note", "note has no empty line"),
        ]
        for name, value, message in cases:
            with self.subTest(name=name, value=value):
                receipt = self.receipt()
                receipt[name] = value
                self.assert_fails(receipt, message)
        receipt = self.receipt()
        del receipt["checkpoint"]
        self.assert_fails(receipt, "receipt has no 'checkpoint'")
        self.assert_fails("[]", "receipt is not a JSON object")
        self.assert_fails("{", "receipt is not valid JSON")
        self.assert_fails(b"\xff", "receipt is not valid UTF-8")
        out = io.StringIO()
        code = main(["receipt", os.path.join(self.tmp.name, "missing"), "--log-key", self.log.vkey], out)
        self.assertEqual(code, 1)
        self.assertIn("FAILED: cannot read receipt", out.getvalue())

    def test_wrong_log_key(self):
        other = Signer(ORIGIN, ALG_ED25519)
        out = io.StringIO()
        code = main(["receipt", self.write(self.receipt()), "--log-key", other.vkey], out)
        self.assertEqual((code, out.getvalue()), (1, f"FAILED: checkpoint is not signed by the log key {ORIGIN}\n"))
        named = Signer("custody.invalid/audit/node-6/01020304", ALG_ED25519, self.log.private)
        out = io.StringIO()
        code = main(["receipt", self.write(self.receipt()), "--log-key", named.vkey], out)
        self.assertEqual(code, 1)
        self.assertIn("is not the log key's name", out.getvalue())

    def test_entry_failures(self):
        receipt = self.receipt()
        cp = receipt["checkpoint"]
        cases = [
            # The proof's index is not the entry's seq (both pointing at the same, valid leaf).
            (dict(self.entry(3, cp), seq=4), "record 1 (page_events seq 4): its proof is of index 3, not its seq 4"),
            # Another record's bytes with this leaf's proof (a record whose seq is not its leaf index, yet
            # in the tree there, is in test_record_columns).
            (self.entry(3, cp, extra=RECORDS[6]), "record 1 (page_events seq 3): inclusion proof does not lead"),
            # The entry names another table than the record's.
            (dict(self.entry(3, cp), table="requests"), "the record is of table 'page_events', not 'requests'"),
            (dict(self.entry(3, cp), seq="3"), "receipt record 1's 'seq' is not an integer"),
            ({"table": "page_events", "seq": 3}, "receipt record 1 has no 'proof'"),
            ([], "receipt record 1 is not a JSON object"),
            (dict(self.entry(3, cp), proof="garbage"), "proof has no empty line"),
            (dict(self.entry(3, cp), proof=format_tlog_proof(TlogProof(3, inclusion_path(3, self.hashes), cp))),
             "its proof has no extra data"),
            (self.entry(1, cp), "record 1 (requests seq 1): seq 1 is listed twice"),
        ]
        for entry, message in cases:
            with self.subTest(message=message):
                receipt = self.receipt()
                receipt["records"][1] = entry
                self.assert_fails(receipt, message)

    def test_record_columns(self):
        # Records that are in the tree but lack what a receipt needs: build a tree of them.
        bad = [
            (encode_record("requests", common(0) + [("tenant", "utf8", "acme")]), "the record has no request_id column"),
            (encode_record("requests", common(0) + [("request_id", "u32", 12), ("tenant", "utf8", "acme")]),
             "the record's request_id is of type u32, not u64"),
            (encode_record("requests", common(0) + [("request_id", "u64", 12), ("tenant", "null", None)]),
             "the record's tenant is of type null, not utf8"),
            (encode_record("requests", [("node_id", "u32", 6)] + common(0)[1:] +
                           [("request_id", "u64", 12), ("tenant", "utf8", "acme")]),
             "the record's node_id is 6, not the receipt's node 5"),
            (encode_record("requests", [c for c in common(0) if c[0] != "seq"] +
                           [("request_id", "u64", 12), ("tenant", "utf8", "acme")]),
             "record of table 'requests' has no seq column"),
            (encode_record("requests", common(0) + [("request_id", "u64", 12), ("tenant", "utf8", "acme"),
                                                    ("tenant", "utf8", "acme")]),
             "record of table 'requests' has column 'tenant' twice"),
            (encode_record("requests", [("seq", "u64", 1)] + [("request_id", "u64", 12), ("tenant", "utf8", "acme")]),
             "the record's seq 1 is not its leaf index 0"),
        ]
        for data, message in bad:
            with self.subTest(message=message):
                self.hashes = [h_leaf(data)]
                cp = self.checkpoint(1)
                proof = format_tlog_proof(TlogProof(0, [], cp, data))
                receipt = {"format": "custody-receipt/1", "node": NODE, "request_id": "req-5-12", "tenant": "acme",
                           "origin": ORIGIN, "tree_size": 1, "checkpoint": cp,
                           "records": [{"table": "requests", "seq": 0, "proof": proof}]}
                self.assert_fails(receipt, "FAILED: record 0 (requests seq 0): " + message)


if __name__ == "__main__":
    unittest.main()
