"""Notices (custody-notice/1): two nodes' logs of different origins (node 5: the receipt tests'
tree; node 2: one of its own), their signed and cosigned checkpoints, tlog-witness consistency
bodies from the tree at the window's start, receipts of tenant acme's requests embedded in a
notice signed by a notice key, and main() on them."""

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

from custody_verify.cli import main
from custody_verify.notes import ALG_COSIGNATURE_V1, ALG_ED25519
from custody_verify.notice import default_sig_path
from custody_verify.proofs import ConsistencyProof, TlogProof, format_consistency_proof, format_tlog_proof

from helpers import Signer, checkpoint_text, consistency_path, encode_record, h_leaf, inclusion_path, mth, sign
from test_receipt import ACME, GLOBEX, ORIGIN, RECORDS, TABLES

NOTICE_KEY_NAME = "custody.invalid/notices"
ORIGIN2 = "custody.invalid/audit/node-2/0a0b0c0d"


def node2_records():
    """Node 2's log: acme's request 4 (seqs 1, 4, 6) read a page globex's request 3 wrote."""
    def common(seq):
        return [("node_id", "u32", 2), ("seq", "u64", seq), ("ts_ns", "u64", 500 + seq),
                ("wall_ns", "i64", 1_700_000_000_000_000_100 + seq)]

    def request(seq, rid, tenant, event):
        return ("requests", encode_record("requests", common(seq) + [
            ("request_id", "u64", rid), ("tenant", "utf8", tenant), ("event", "utf8", event),
            ("reason", "null", None), ("prompt_tokens", "u32", 3), ("output_tokens", "u32", 0)]))

    return [
        ("writer_events", encode_record("writer_events", common(0) + [("event", "utf8", "started"),
                                                                      ("detail", "null", None)])),
        request(1, 4, "acme", "admitted"),
        request(2, 3, "globex", "admitted"),
        ("page_events", encode_record("page_events", common(3) + [
            ("request_id", "u64", 3), ("tenant", "utf8", "globex"), ("event", "utf8", "alloc"),
            ("page", "u32", 7), ("generation", "u32", 1)])),
        ("page_reads", encode_record("page_reads", common(4) + [
            ("request_id", "u64", 4), ("tenant", "utf8", "acme"), ("page", "u32", 7), ("generation", "u32", 1),
            ("first_step", "u64", 0), ("last_step", "u64", 2), ("verdict", "utf8", "unchecked")])),
        request(5, 3, "globex", "finished"),
        request(6, 4, "acme", "finished"),
    ]


class Log:
    """One node's log: its records, signer, checkpoints, receipts and consistency bodies."""

    def __init__(self, node, origin, records, tables, witnesses):
        self.node, self.origin, self.records, self.tables = node, origin, records, tables
        self.signer = Signer(origin, ALG_ED25519)
        self.witnesses = witnesses  # who cosigns the checkpoint now
        self.hashes = [h_leaf(r) for r in records]

    @property
    def size(self):
        return len(self.records)

    def checkpoint(self, size=None):
        size = self.size if size is None else size
        text = checkpoint_text(self.origin, size, mth(self.hashes[:size]))
        return sign(text, self.signer.line(text),
                    *(w.line(text, 1_700_000_000 + i) for i, w in enumerate(self.witnesses)))

    def receipt(self, seqs, request_id, tenant="acme", extra=None):
        cp = self.checkpoint()
        records = []
        for seq in seqs:
            data = (extra or {}).get(seq, self.records[seq])
            proof = TlogProof(seq, inclusion_path(seq, self.hashes), cp, data)
            records.append({"table": self.tables[seq], "seq": seq, "proof": format_tlog_proof(proof)})
        return {"format": "custody-receipt/1", "node": self.node, "request_id": request_id, "tenant": tenant,
                "origin": self.origin, "tree_size": self.size, "checkpoint": cp, "records": records}

    def window(self, old_size, old_root=None, proof=None, body_old=None):
        if old_root is None and old_size > 0:
            old_root = mth(self.hashes[:old_size])
        proof = consistency_path(old_size, self.hashes) if proof is None else proof
        body = format_consistency_proof(ConsistencyProof(old_size if body_old is None else body_old, proof,
                                                         self.checkpoint()))
        return {"node": self.node, "origin": self.origin, "old_size": old_size,
                "old_root": base64.b64encode(old_root).decode() if old_root is not None else None,
                "tree_size": self.size, "consistency": body}


class NoticeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.w1 = Signer("witness1.example/w", ALG_COSIGNATURE_V1)
        self.w2 = Signer("witness2.example/w", ALG_COSIGNATURE_V1)
        self.notice_key = Signer(NOTICE_KEY_NAME, ALG_ED25519)
        self.node5 = Log(5, ORIGIN, RECORDS, TABLES, [self.w1])
        n2 = node2_records()
        self.node2 = Log(2, ORIGIN2, [r for _, r in n2], {i: t for i, (t, _) in enumerate(n2)}, [self.w1])

    def tearDown(self):
        self.tmp.cleanup()

    # --- building notices ------------------------------------------------------------------

    def exposed(self):
        """acme's response req-2-4 read globex's slots on node 2; responses of others read what
        acme's req-5-12 wrote on node 5."""
        return {
            "format": "custody-notice/1", "tenant": "acme", "issued_wall_ns": 1_700_000_100_000_000_000,
            "window": {"from_wall_ns": 1_700_000_000_000_000_000, "to_wall_ns": 1_700_000_100_000_000_000},
            "exposed": True, "summary": "acme: 1 response could have read 1 foreign slot; 1 request's slots "
                                        "could have been read by 1 response of other tenants",
            "as_recipient": [{"node": 2, "request_id": "req-2-4", "foreign_slots": 1,
                              "first_wall_ns": 1_700_000_000_000_000_104,
                              "last_wall_ns": 1_700_000_000_000_000_104, "unchecked": True,
                              "source_requests": 1, "receipt": self.node2.receipt([1, 4, 6], "req-2-4")}],
            "as_source": [{"node": 5, "request_id": "req-5-12", "foreign_slots": 1,
                           "first_wall_ns": 1_700_000_000_000_000_006,
                           "last_wall_ns": 1_700_000_000_000_000_006, "unchecked": False,
                           "responses": 1, "receipt": self.node5.receipt(ACME, "req-5-12")}],
            "truncated": False,
            "logs": [self.node2.window(3), self.node5.window(6)],
        }

    def not_exposed(self):
        return {"format": "custody-notice/1", "tenant": "acme", "issued_wall_ns": 1,
                "window": {"from_wall_ns": 0, "to_wall_ns": 1}, "exposed": False,
                "summary": "acme: no exposure", "as_recipient": [], "as_source": [], "truncated": False,
                "logs": [self.node5.window(0), self.node2.window(self.node2.size)]}

    def sig_text(self, data, tenant="acme"):
        return f"custody.notice/1\n{tenant}\n{base64.b64encode(hashlib.sha256(data).digest()).decode()}\n"

    def write(self, notice, name="acme.notice.json", signer=None, tenant="acme", signed=None):
        """The notice's file and, beside it, its .sig (over `signed` bytes if given)."""
        data = notice if isinstance(notice, bytes) else json.dumps(notice, indent=1).encode()
        path = os.path.join(self.tmp.name, name)
        with open(path, "wb") as f:
            f.write(data)
        text = self.sig_text(data if signed is None else signed, tenant)
        with open(default_sig_path(path), "w") as f:
            f.write(sign(text, (signer or self.notice_key).line(text)))
        return path

    def keys(self):
        return ["--notice-key", self.notice_key.vkey, "--log-key", self.node5.signer.vkey,
                "--log-key", self.node2.signer.vkey]

    def run_cli(self, notice, *extra_args, keys=None, **write):
        path = notice if isinstance(notice, str) else self.write(notice, **write)
        out = io.StringIO()
        code = main(["notice", path, *(self.keys() if keys is None else keys), *extra_args], out)
        return code, out.getvalue()

    def assert_fails(self, notice, message, *extra_args, keys=None, **write):
        code, out = self.run_cli(notice, *extra_args, keys=keys, **write)
        self.assertEqual(code, 1, out)
        self.assertTrue(out.startswith("FAILED: "), out)
        self.assertIn(message, out)
        self.assertEqual(out.count("\n"), 1, out)

    # --- success ---------------------------------------------------------------------------

    def test_exposed(self):
        code, out = self.run_cli(self.exposed(), "--witness-key", self.w1.vkey)
        self.assertEqual(code, 0, out)
        self.assertEqual(out, "\n".join([
            "OK: notice for tenant acme: EXPOSED",
            "acme: 1 response could have read 1 foreign slot; 1 request's slots could have been read by 1 "
            "response of other tenants",
            "window (wall-clock ns): 1700000000000000000 to 1700000100000000000",
            "2 receipt(s) checked",
            f"  as_recipient req-2-4 (node 2): 3 records in the tree of 7 records of {ORIGIN2}",
            f"  as_source req-5-12 (node 5): 5 records in the tree of 11 records of {ORIGIN}",
            f"node 2: the tree of 7 records of {ORIGIN2} extends the one of 3 (consistency proved)",
            "  cosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)",
            f"node 5: the tree of 11 records of {ORIGIN} extends the one of 6 (consistency proved)",
            "  cosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)",
        ]) + "\n")
        # Without witness keys the cosignatures are neither required nor listed; key order is free.
        code, out = self.run_cli(self.exposed(), keys=["--log-key", self.node2.signer.vkey, "--notice-key",
                                                       self.notice_key.vkey, "--log-key", self.node5.signer.vkey])
        self.assertEqual(code, 0, out)
        self.assertNotIn("cosigned", out)

    def test_every_old_size(self):
        for old in range(0, self.node5.size + 1):
            with self.subTest(old=old):
                notice = self.exposed()
                notice["logs"][1] = self.node5.window(old)
                code, out = self.run_cli(notice)
                self.assertEqual(code, 0, out)
                if old == 0:
                    self.assertIn(f"node 5: the tree of 11 records of {ORIGIN} (nothing was sealed before the "
                                  "window)\n", out)
                elif old == 11:
                    self.assertIn(f"node 5: the tree of 11 records of {ORIGIN} is the tree at the window's start "
                                  "(no record since)\n", out)
                else:
                    self.assertIn(f"extends the one of {old} (consistency proved)\n", out)

    def test_not_exposed(self):
        code, out = self.run_cli(self.not_exposed(), "--witness-key", self.w1.vkey)
        self.assertEqual(code, 0, out)
        self.assertEqual(out, "\n".join([
            "OK: notice for tenant acme: not exposed",
            "acme: no exposure",
            "window (wall-clock ns): 0 to 1",
            "0 receipt(s) checked",
            f"node 5: the tree of 11 records of {ORIGIN} (nothing was sealed before the window)",
            "  cosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)",
            f"node 2: the tree of 7 records of {ORIGIN2} is the tree at the window's start (no record since)",
            "  cosigned by witness1.example/w at 2023-11-14T22:13:20Z (1700000000)",
        ]) + "\n")
        # The old root given at size 0 (the empty tree's) and at the same size (the checkpoint's).
        notice = self.not_exposed()
        notice["logs"] = [self.node5.window(0, old_root=hashlib.sha256(b"").digest()),
                          self.node2.window(self.node2.size, old_root=mth(self.node2.hashes))]
        code, out = self.run_cli(notice)
        self.assertEqual(code, 0, out)
        notice["logs"][1]["old_root"] = None
        code, out = self.run_cli(notice)
        self.assertEqual(code, 0, out)

    def test_receipt_missing(self):
        notice = self.exposed()
        del notice["as_source"][0]["receipt"]
        notice["as_source"][0]["receipt_missing"] = "not sealed and checkpointed yet"
        notice["as_recipient"][0]["receipt"] = None  # null counts as absent
        notice["as_recipient"][0]["receipt_missing"] = "in an earlier incarnation's log"
        code, out = self.run_cli(notice)
        self.assertEqual(code, 0, out)
        self.assertIn("\n0 receipt(s) checked\n"
                      "receipt missing: as_recipient req-2-4 (node 2): in an earlier incarnation's log\n"
                      "receipt missing: as_source req-5-12 (node 5): not sealed and checkpointed yet\n"
                      f"node 2: ", out)
        notice = self.exposed()
        notice["as_source"][0]["receipt_missing"] = "both"
        self.assert_fails(notice, "FAILED: as_source[0] (req-5-12 on node 5) has both a receipt and receipt_missing")
        del notice["as_source"][0]["receipt"]
        del notice["as_source"][0]["receipt_missing"]
        self.assert_fails(notice, "as_source[0] (req-5-12 on node 5) has neither a receipt nor receipt_missing")
        notice["as_source"][0]["receipt_missing"] = 3
        self.assert_fails(notice, "as_source[0] (req-5-12 on node 5)'s 'receipt_missing' is not a string")

    def test_truncated(self):
        notice = self.exposed()
        notice["truncated"] = True
        code, out = self.run_cli(notice)
        self.assertEqual(code, 0, out)
        self.assertIn("\ntruncated: the notice lists only part of the requests found\nnode 2: ", out)

    def test_default_sig_path(self):
        self.assertEqual(default_sig_path("/d/acme.notice.json"), "/d/acme.notice.sig")
        self.assertEqual(default_sig_path("acme.notice"), "acme.notice.sig")
        path = self.write(self.exposed())
        self.assertTrue(os.path.exists(os.path.join(self.tmp.name, "acme.notice.sig")))
        code, out = self.run_cli(path)
        self.assertEqual(code, 0, out)
        # --sig elsewhere: the default (now another file's signature) is not read.
        os.rename(os.path.join(self.tmp.name, "acme.notice.sig"), os.path.join(self.tmp.name, "elsewhere"))
        code, out = self.run_cli(path)
        self.assertEqual(code, 1)
        self.assertTrue(out.startswith(f"FAILED: cannot read notice signature {self.tmp.name}/acme.notice.sig"), out)
        code, out = self.run_cli(path, "--sig", os.path.join(self.tmp.name, "elsewhere"))
        self.assertEqual(code, 0, out)
        other = self.write(self.not_exposed(), name="other.notice.json")
        code, out = self.run_cli(path, "--sig", default_sig_path(other))
        self.assertEqual(code, 1)
        self.assertIn("FAILED: the notice signature is over other bytes", out)

    def test_key_files(self):
        notice_key = os.path.join(self.tmp.name, "notices.vkey")
        with open(notice_key, "w") as f:
            f.write(self.notice_key.vkey + "\n")
        log_keys = os.path.join(self.tmp.name, "logs.vkeys")
        with open(log_keys, "w") as f:
            f.write(f"{self.node5.signer.vkey}\n\n{self.node2.signer.vkey}\n")
        code, out = self.run_cli(self.exposed(), keys=["--notice-key-file", notice_key, "--log-key-file", log_keys])
        self.assertEqual(code, 0, out)

    def test_python_dash_m(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = self.write(self.exposed())
        run = subprocess.run([sys.executable, "-m", "custody_verify", "notice", path, *self.keys()],
                             cwd=root, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertTrue(run.stdout.startswith("OK: notice for tenant acme: EXPOSED\n"), run.stdout)
        # Usage errors: no log key, no notice key.
        for args in (["--notice-key", self.notice_key.vkey], ["--log-key", self.node5.signer.vkey]):
            run = subprocess.run([sys.executable, "-m", "custody_verify", "notice", path, *args],
                                 cwd=root, capture_output=True, text=True)
            self.assertEqual(run.returncode, 2, run.stdout + run.stderr)
            self.assertEqual(run.stdout, "")

    # --- the signature ---------------------------------------------------------------------

    def test_wrong_notice_key(self):
        other = Signer(NOTICE_KEY_NAME, ALG_ED25519)  # the same name, another key
        self.assert_fails(self.exposed(), f"FAILED: the notice signature is not signed by the notice key "
                                          f"{NOTICE_KEY_NAME} ({self.notice_key.key.key_id:08x})", signer=other)
        # The right private key under another name: its line is not the notice key's.
        renamed = Signer("custody.invalid/other", ALG_ED25519, self.notice_key.private)
        self.assert_fails(self.exposed(), "the notice signature is not signed by the notice key", signer=renamed)
        # A line in the notice key's name and id that does not verify.
        path = self.write(self.exposed())
        with open(default_sig_path(path)) as f:
            note = f.read()
        with open(path, "rb") as f:
            data = f.read()
        forged = note.replace(self.sig_text(data), self.sig_text(data, "globex"))
        with open(default_sig_path(path), "w") as f:
            f.write(forged)
        self.assert_fails(path, f"FAILED: notice signature: signature by {NOTICE_KEY_NAME} (")
        # A log key as the notice key.
        self.assert_fails(self.exposed(), "the notice signature is not signed by the notice key",
                          keys=["--notice-key", self.node5.signer.vkey, "--log-key", self.node5.signer.vkey,
                                "--log-key", self.node2.signer.vkey])
        self.assert_fails(self.exposed(), "notice key witness1.example/w is type 0x04",
                          keys=["--notice-key", self.w1.vkey, "--log-key", self.node5.signer.vkey])

    def test_signature_over_other_bytes(self):
        data = json.dumps(self.exposed(), indent=1).encode()
        at = data.index(b'"foreign_slots": 1') + len(b'"foreign_slots": ')
        changed = data[:at] + b"2" + data[at + 1:]  # 1 foreign slot -> 2: one byte
        self.assert_fails(changed, "FAILED: the notice signature is over other bytes: it signs SHA-256 "
                                   f"{base64.b64encode(hashlib.sha256(data).digest()).decode()}, the notice file's "
                                   f"is {base64.b64encode(hashlib.sha256(changed).digest()).decode()}", signed=data)
        # Whitespace counts too: the signature is over the file's bytes, not its JSON.
        self.assert_fails(data + b"\n", "the notice signature is over other bytes", signed=data)

    def test_tenant_line(self):
        self.assert_fails(self.exposed(), "FAILED: the notice signature is of tenant 'globex', the notice of 'acme'",
                          tenant="globex")
        self.assert_fails(self.exposed(), "the notice signature is of tenant 'acm', the notice of 'acme'",
                          tenant="acm")
        # Malformed signed texts.
        for text, message in [
            ("custody.notice/2\nacme\n{h}\n", "the notice signature's text is not 'custody.notice/1'"),
            ("custody.notice/1\n{h}\n", "the notice signature's text is not 'custody.notice/1'"),
            ("custody.notice/1\nacme\n{h}\nmore\n", "the notice signature's text is not"),
            ("custody.notice/1\nacme\n{h}x\n", "the notice signature's hash is not valid base64"),
            ("custody.notice/1\nacme\nAAAA\n", "the notice signature's hash is 3 bytes, not 32"),
        ]:
            with self.subTest(text=text):
                path = self.write(self.exposed())
                with open(path, "rb") as f:
                    h = base64.b64encode(hashlib.sha256(f.read()).digest()).decode()
                text = text.format(h=h)
                with open(default_sig_path(path), "w") as f:
                    f.write(sign(text, self.notice_key.line(text)))
                self.assert_fails(path, message)

    # --- the notice's own fields -----------------------------------------------------------

    def test_exposed_inconsistent(self):
        notice = self.exposed()
        notice["exposed"] = False
        self.assert_fails(notice, "FAILED: the notice says exposed: false but lists 2 request(s)")
        notice["as_recipient"] = []
        self.assert_fails(notice, "the notice says exposed: false but lists 1 request(s)")
        notice = self.not_exposed()
        notice["exposed"] = True
        self.assert_fails(notice, "FAILED: the notice says exposed: true but lists no request")
        notice["exposed"] = 1
        self.assert_fails(notice, "notice's 'exposed' is not a boolean")

    def test_header_failures(self):
        cases = [
            ("format", "custody-notice/2", "notice format is 'custody-notice/2', not 'custody-notice/1'"),
            ("tenant", 7, "notice's 'tenant' is not a string"),
            ("as_source", {}, "notice's 'as_source' is not a list"),
            ("logs", None, "notice's 'logs' is not a list"),
            ("summary", 1, "notice's 'summary' is not a string"),
            ("truncated", "no", "notice's 'truncated' is not a boolean"),
            ("window", [], "notice's 'window' is not an object"),
            ("window", {"from_wall_ns": "0"}, "notice window's 'from_wall_ns' is not an i64"),
            ("issued_wall_ns", 1 << 63, "notice's 'issued_wall_ns' is not an i64"),
        ]
        for name, value, message in cases:
            with self.subTest(name=name, value=value):
                notice = self.exposed()
                notice[name] = value
                self.assert_fails(notice, message)
        notice = self.exposed()
        del notice["as_recipient"]
        self.assert_fails(notice, "notice has no 'as_recipient'")
        self.assert_fails(b"[]", "FAILED: notice is not a JSON object")
        self.assert_fails(b"{", "notice is not valid JSON")
        self.assert_fails(b"\xff", "notice is not valid UTF-8")
        code, out = self.run_cli(os.path.join(self.tmp.name, "missing.notice.json"))
        self.assertEqual(code, 1)
        self.assertIn("FAILED: cannot read notice", out)

    def test_entry_failures(self):
        cases = [
            ("node", "2", "as_recipient[0]'s 'node' is not an integer"),
            ("request_id", 4, "as_recipient[0]'s 'request_id' is not a string"),
            ("foreign_slots", -1, "as_recipient[0]'s 'foreign_slots' -1 is not a u64"),
            ("source_requests", 1.5, "as_recipient[0]'s 'source_requests' is not an integer"),
            ("first_wall_ns", "x", "as_recipient[0]'s 'first_wall_ns' is not an i64"),
            ("unchecked", "yes", "as_recipient[0]'s 'unchecked' is not a boolean"),
        ]
        for name, value, message in cases:
            with self.subTest(name=name, value=value):
                notice = self.exposed()
                notice["as_recipient"][0][name] = value
                self.assert_fails(notice, message)
        notice = self.exposed()
        notice["as_source"].append("req-5-13")
        self.assert_fails(notice, "FAILED: as_source[1] is not a JSON object")

    # --- the embedded receipts -------------------------------------------------------------

    def test_receipt_of_another_tenant(self):
        notice = self.exposed()
        notice["as_source"].append({"node": 5, "request_id": "req-5-13", "foreign_slots": 1, "responses": 1,
                                    "receipt": self.node5.receipt(GLOBEX, "req-5-13", "globex")})
        self.assert_fails(notice, "FAILED: as_source[1] (req-5-13 on node 5): the receipt is of tenant 'globex', "
                                  "not the notice's 'acme'")
        # Relabelled as acme's: its records are globex's.
        notice["as_source"][1]["receipt"]["tenant"] = "acme"
        self.assert_fails(notice, "as_source[1] (req-5-13 on node 5): record 0 (requests seq 2): the record's tenant "
                                  "is 'globex', not the receipt's 'acme'")

    def test_receipt_of_another_request(self):
        notice = self.exposed()
        notice["as_source"][0]["request_id"] = "req-5-99"
        self.assert_fails(notice, "FAILED: as_source[0] (req-5-99 on node 5): the receipt is of request 'req-5-12', "
                                  "not the entry's 'req-5-99'")
        # The receipt of node 2's request under node 5's entry.
        notice = self.exposed()
        notice["as_source"][0]["receipt"] = self.node2.receipt([1, 4, 6], "req-2-4")
        self.assert_fails(notice, "as_source[0] (req-5-12 on node 5): the receipt is of request 'req-2-4'")
        notice["as_source"][0]["request_id"] = "req-2-4"
        self.assert_fails(notice, "as_source[0] (req-2-4 on node 5): the receipt is of node 2, not the entry's 5")

    def test_tampered_receipt_record(self):
        bad = bytearray(self.node2.records[4])
        bad[-3] ^= 1  # the verdict
        notice = self.exposed()
        notice["as_recipient"][0]["receipt"] = self.node2.receipt([1, 4, 6], "req-2-4", extra={4: bytes(bad)})
        self.assert_fails(notice, "FAILED: as_recipient[0] (req-2-4 on node 2): record 1 (page_reads seq 4): "
                                  "inclusion proof does not lead to the root")
        # A record dropped from the receipt is not detectable by the receipt alone, a record of another
        # request of the same tenant added is.
        notice = self.exposed()
        notice["as_recipient"][0]["receipt"] = self.node2.receipt([1, 2, 4], "req-2-4")
        self.assert_fails(notice, "record 1 (requests seq 2): the record's tenant is 'globex'")
        # The receipt's checkpoint is signed by another key under the same origin.
        notice = self.exposed()
        receipt = notice["as_source"][0]["receipt"]
        forged = Log(5, ORIGIN, RECORDS, TABLES, [self.w1])
        notice["as_source"][0]["receipt"] = forged.receipt(ACME, "req-5-12")
        self.assertNotEqual(receipt["checkpoint"], notice["as_source"][0]["receipt"]["checkpoint"])
        self.assert_fails(notice, f"as_source[0] (req-5-12 on node 5): checkpoint is not signed by the log key {ORIGIN}")

    def test_missing_log_key(self):
        self.assert_fails(self.exposed(), f"FAILED: the log of node 2 ({ORIGIN2}): no --log-key named {ORIGIN2!r} "
                                          "(the log of node 2)",
                          keys=["--notice-key", self.notice_key.vkey, "--log-key", self.node5.signer.vkey])
        # No log of node 2 listed: the receipt still needs its key.
        notice = self.exposed()
        notice["logs"] = [self.node5.window(6)]
        self.assert_fails(notice, f"FAILED: as_recipient[0] (req-2-4 on node 2): no --log-key named {ORIGIN2!r} "
                                  "(the receipt's origin)",
                          keys=["--notice-key", self.notice_key.vkey, "--log-key", self.node5.signer.vkey])
        # Two different keys of one origin.
        other = Signer(ORIGIN, ALG_ED25519)
        self.assert_fails(self.exposed(), f"FAILED: two different log keys are named {ORIGIN!r}",
                          "--log-key", other.vkey)
        self.assert_fails(self.exposed(), "log key witness1.example/w is type 0x04", "--log-key", self.w1.vkey)

    # --- the logs --------------------------------------------------------------------------

    def test_bad_consistency_proof(self):
        prefix = f"FAILED: the log of node 5 ({ORIGIN}): "
        # A hash of the proof changed.
        proof = consistency_path(6, self.node5.hashes)
        proof[0] = hashlib.sha256(proof[0]).digest()
        notice = self.exposed()
        notice["logs"][1] = self.node5.window(6, proof=proof)
        self.assert_fails(notice, prefix + "consistency proof does not lead to the old root")
        # A fork: the tree at the window's start had another record 5.
        hashes = list(self.node5.hashes)
        hashes[5] = h_leaf(b"rewritten")
        notice["logs"][1] = self.node5.window(6, old_root=mth(hashes[:6]))
        self.assert_fails(notice, prefix + "consistency proof does not lead to the old root")
        # The proof of another old size.
        notice["logs"][1] = self.node5.window(6, proof=consistency_path(5, self.node5.hashes))
        self.assert_fails(notice, prefix + "consistency proof")
        # A proof missing its last hash.
        notice["logs"][1] = self.node5.window(6, proof=consistency_path(6, self.node5.hashes)[:-1])
        self.assert_fails(notice, prefix + "consistency proof is too short")
        # old_root null where a proof is needed, not base64, not 32 bytes.
        for value, message in [(None, "old_root is null, but old_size is 6"),
                               ("!", "old_root is not valid base64"), ("AAAA", "old_root is 3 bytes, not 32")]:
            with self.subTest(old_root=value):
                notice["logs"][1] = self.node5.window(6)
                notice["logs"][1]["old_root"] = value
                self.assert_fails(notice, prefix + message)
        # Proof hashes where none can be, an old root at size 0 or at the same size that is not the tree's.
        notice["logs"][1] = self.node5.window(0, proof=[mth(self.node5.hashes)])
        self.assert_fails(notice, prefix + "the consistency proof from size 0 to 11 must have no hashes, it has 1")
        notice["logs"][1] = self.node5.window(11, proof=[mth(self.node5.hashes)])
        self.assert_fails(notice, prefix + "the consistency proof from size 11 to 11 must have no hashes, it has 1")
        notice["logs"][1] = self.node5.window(0, old_root=mth(self.node5.hashes[:1]))
        self.assert_fails(notice, prefix + "old_root is not the empty tree's root, but old_size is 0")
        notice["logs"][1] = self.node5.window(11, old_root=mth(self.node5.hashes[:10]))
        self.assert_fails(notice, prefix + "old_root is not the checkpoint's root, at the same size 11")

    def test_log_sizes(self):
        prefix = f"FAILED: the log of node 5 ({ORIGIN}): "
        notice = self.exposed()
        notice["logs"][1] = self.node5.window(6)
        notice["logs"][1]["old_size"] = 12
        self.assert_fails(notice, prefix + "old_size 12 is larger than tree_size 11")
        notice["logs"][1] = self.node5.window(6, body_old=5)
        self.assert_fails(notice, prefix + "the consistency proof is from size 5, not old_size 6")
        for size in (10, 12):
            with self.subTest(tree_size=size):
                notice["logs"][1] = self.node5.window(6)
                notice["logs"][1]["tree_size"] = size
                self.assert_fails(notice, prefix + f"tree_size {size} is not the checkpoint's size 11")

    def test_log_fields(self):
        notice = self.exposed()
        notice["logs"][1]["origin"] = ORIGIN2  # node 2's key: it does not sign node 5's checkpoint
        self.assert_fails(notice, f"FAILED: the log of node 5 ({ORIGIN2}): checkpoint origin {ORIGIN!r} is not the "
                                  f"log key's name {ORIGIN2!r}")
        for name, value, message in [("old_size", -1, "logs[1]'s 'old_size' -1 is not a u64"),
                                     ("tree_size", None, "logs[1]'s 'tree_size' is not an integer"),
                                     ("consistency", ["old 6"], "logs[1]'s 'consistency' is not a string"),
                                     ("old_root", 0, "logs[1]'s 'old_root' is not a string")]:
            with self.subTest(name=name):
                notice = self.exposed()
                notice["logs"][1][name] = value
                self.assert_fails(notice, message)
        notice = self.exposed()
        notice["logs"][1]["consistency"] = "old 6\n"
        self.assert_fails(notice, "consistency proof has no empty line before the checkpoint")
        notice = self.exposed()
        notice["logs"].append([])
        self.assert_fails(notice, "FAILED: logs[2] is not a JSON object")

    def test_witness_quorum(self):
        w = ["--witness-key", self.w1.vkey, "--witness-key", self.w2.vkey]
        # Cosigned by w1 only: two required fails (the first checkpoint checked is node 2's log).
        self.assert_fails(self.exposed(), f"FAILED: the log of node 2 ({ORIGIN2}): 1 witness cosignature(s) verified, "
                                          "2 required", *w)
        code, out = self.run_cli(self.exposed(), *w, "--min-witnesses", "1")
        self.assertEqual(code, 0, out)
        # Cosigned by both: the receipts and the logs carry both.
        self.node2.witnesses = self.node5.witnesses = [self.w1, self.w2]
        code, out = self.run_cli(self.exposed(), *w)
        self.assertEqual(code, 0, out)
        self.assertEqual(out.count("cosigned by witness2.example/w"), 2, out)
        # Node 5's checkpoint not cosigned: its log fails, and so does its receipt where the log does not.
        self.node5.witnesses = []
        self.assert_fails(self.exposed(), f"FAILED: the log of node 5 ({ORIGIN}): 0 witness cosignature(s) verified, "
                                          "1 required", "--witness-key", self.w1.vkey)
        notice = self.exposed()
        self.node5.witnesses = [self.w1]
        notice["logs"][1] = self.node5.window(6)
        self.assert_fails(notice, "FAILED: as_source[0] (req-5-12 on node 5): 0 witness cosignature(s) verified, "
                                  "1 required", "--witness-key", self.w1.vkey)
        code, out = self.run_cli(notice, "--witness-key", self.w1.vkey, "--min-witnesses", "0")
        self.assertEqual(code, 0, out)
        # A cosignature by another key under the witness's name does not count.
        self.node5.witnesses = [Signer("witness1.example/w", ALG_COSIGNATURE_V1)]
        self.assert_fails(self.exposed(), "FAILED: the log of node 5", "--witness-key", self.w1.vkey)


if __name__ == "__main__":
    unittest.main()
