"""The promise in the answer (custody.receipt.promise/1, in `custody_receipt`): signed notes of a
request's records made by the log's key, alone and held to the receipt of test_receipt's tree."""

import base64
import io
import json
import os
import subprocess
import sys
import unittest

from custody_verify import VerifyError
from custody_verify.cli import main
from custody_verify.notes import ALG_ED25519
from custody_verify.promise import parse_promise

from helpers import Signer, checkpoint_text, h_leaf, mth, sign
from test_receipt import ACME, GLOBEX, ORIGIN, RECORDS, TABLES, ReceiptFixture, page_event

def B64(raw):
    return base64.b64encode(raw).decode()


def promise_text(origin, request_id, tenant, records, count=None):
    """records: (seq, table, leaf bytes); count: the number line, if not len(records)."""
    lines = ["custody.receipt.promise/1", origin, request_id, tenant, str(len(records) if count is None else count)]
    lines += [f"{seq} {table} {B64(leaf)}" for seq, table, leaf in records]
    return "\n".join(lines) + "\n"


def promised(seqs):
    return [(s, TABLES[s], h_leaf(RECORDS[s])) for s in seqs]


class PromiseTest(ReceiptFixture, unittest.TestCase):
    def note(self, seqs=ACME, request_id="req-5-12", tenant="acme", records=None, signer=None, text=None):
        text = text if text is not None else promise_text(
            ORIGIN, request_id, tenant, promised(seqs) if records is None else records)
        return sign(text, (signer or self.log).line(text))

    def entry_of(self, note, request_id="req-5-12", records=None):
        return {"request_id": request_id, "fetch": f"/v1/audit/receipt/{request_id}", "origin": ORIGIN,
                "records": [{"seq": s, "table": t, "leaf": B64(h)} for s, t, h in records],
                "promise": note}

    def container(self, *entries):
        return {"format": "custody-receipt-promise/1", "node": 5, "requests": list(entries)}

    def acme_container(self, seqs=ACME):
        return self.container(self.entry_of(self.note(seqs), records=promised(seqs)))

    def with_promise(self, promise, receipt=None, *extra_args):
        """main() on `receipt --promise`; the promise is a note (str) or JSON (dict)."""
        receipt = self.receipt() if receipt is None else receipt
        path = self.write(promise if isinstance(promise, (str, bytes)) else json.dumps(promise), "promise")
        return self.run_cli(receipt, "--promise", path, *extra_args)

    def standalone(self, promise, *extra_args):
        path = self.write(promise if isinstance(promise, str) else json.dumps(promise), "promise")
        out = io.StringIO()
        code = main(["promise", path, "--log-key", self.log.vkey, *extra_args], out)
        return code, out.getvalue()

    def assert_promise_fails(self, promise, message, receipt=None, standalone=True):
        code, out = self.with_promise(promise, receipt)
        self.assertEqual(code, 1, out)
        self.assertTrue(out.startswith("FAILED: "), out)
        self.assertIn(message, out)
        self.assertEqual(out.count("\n"), 1, out)
        if standalone:
            code, out = self.standalone(promise)
            self.assertEqual(code, 1, out)
            self.assertEqual(out.count("\n"), 1, out)
            self.assertIn(message, out)

    # --- kept ----------------------------------------------------------------------------

    def test_round_trip(self):
        code, plain = self.run_cli(self.receipt())
        self.assertEqual(code, 0, plain)
        code, out = self.with_promise(self.note())
        self.assertEqual(code, 0, out)
        self.assertEqual(out, plain + "promise kept: the 5 records promised in the answer are in the log, unchanged\n")
        code, out = self.standalone(self.note(), "--request-id", "req-5-12")
        self.assertEqual(code, 0, out)
        self.assertEqual(out, "\n".join(
            [f"OK: req-5-12 of tenant acme: 5 records promised by {ORIGIN}"] +
            [f"  seq {s} {TABLES[s]} {B64(h_leaf(RECORDS[s]))}" for s in ACME]) + "\n")
        # The other tenant's request, with --log-key-file and a cosigned receipt.
        key = self.write(self.log.vkey + "\n", "key")
        path = self.write(self.note(GLOBEX, "req-5-13", "globex"), "promise")
        out = io.StringIO()
        code = main(["receipt", self.write(self.receipt(GLOBEX, "req-5-13", "globex")), "--log-key-file", key,
                     "--witness-key", self.w1.vkey, "--promise", path], out)
        self.assertEqual(code, 0, out.getvalue())
        self.assertTrue(out.getvalue().endswith("\npromise kept: the 3 records promised in the answer are in the "
                                                "log, unchanged\n"), out.getvalue())

    def test_records_after_the_answer(self):
        code, out = self.with_promise(self.note([1, 3, 6]))
        self.assertEqual(code, 0, out)
        self.assertTrue(out.endswith(
            "promise kept: the 3 records promised in the answer are in the log, unchanged\n"
            "2 recorded after the answer (not in the promise): seq 7 (requests), seq 9 (page_events)\n"), out)
        # A promise of no record at all is kept by any receipt of the request.
        code, out = self.with_promise(self.note([]))
        self.assertEqual(code, 0, out)
        self.assertIn("the 0 records promised", out)
        self.assertIn("\n5 recorded after the answer (not in the promise): seq 1 (requests), ", out)

    def test_containers(self):
        container = self.acme_container()
        body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 7}, "custody_receipt": container}
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "custody_receipt": container}
        first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in (first, chunk, chunk)) + "data: [DONE]\n\n"
        for name, promise in [("body", body), ("chunk", chunk), ("object", container), ("note", self.note()),
                              ("sse", sse)]:
            with self.subTest(name=name):
                code, out = self.with_promise(promise)
                self.assertEqual(code, 0, out)
                self.assertTrue(out.endswith("promise kept: the 5 records promised in the answer are in the log, "
                                             "unchanged\n"), out)
                code, out = self.standalone(promise)
                self.assertEqual(code, 0, out)
                self.assertTrue(out.startswith("OK: req-5-12 of tenant acme: 5 records promised by "), out)

    def test_one_entry_per_choice(self):
        acme = self.entry_of(self.note(), records=promised(ACME))
        globex = self.entry_of(self.note(GLOBEX, "req-5-13", "globex"), "req-5-13", promised(GLOBEX))
        both = {"custody_receipt": self.container(globex, acme)}
        code, out = self.with_promise(both)
        self.assertEqual(code, 0, out)
        self.assertIn("promise kept: the 5 records", out)
        code, out = self.with_promise(both, self.receipt(GLOBEX, "req-5-13", "globex"))
        self.assertEqual(code, 0, out)
        self.assertIn("promise kept: the 3 records", out)
        code, out = self.standalone(both)
        self.assertEqual(code, 0, out)
        self.assertEqual([line for line in out.splitlines() if line.startswith("OK")], [
            f"OK: req-5-13 of tenant globex: 3 records promised by {ORIGIN}",
            f"OK: req-5-12 of tenant acme: 5 records promised by {ORIGIN}"])
        code, out = self.standalone(both, "--request-id", "req-5-13")
        self.assertEqual(code, 0, out)
        self.assertEqual(out.count("OK"), 1, out)
        # With an error beside them: the receipt of another request still checks.
        error = {"request_id": "req-5-14", "fetch": "/v1/audit/receipt/req-5-14", "error": "index lost part of it"}
        code, out = self.with_promise(self.container(acme, error))
        self.assertEqual(code, 0, out)

    # --- not a valid promise -------------------------------------------------------------

    def test_wrong_key(self):
        other = Signer(ORIGIN, ALG_ED25519)
        self.assert_promise_fails(self.note(signer=other), f"FAILED: promise is not signed by the log key {ORIGIN}")
        # The log's private key under another key name: not the origin's signature line.
        renamed = Signer("custody.invalid/audit/node-6/01020304", ALG_ED25519, self.log.private)
        self.assert_promise_fails(self.note(signer=renamed), "promise is not signed by the log key")
        # A promise of another log, signed by that log's key.
        text = promise_text(renamed.name, "req-5-12", "acme", promised(ACME))
        self.assert_promise_fails(sign(text, renamed.line(text)), "FAILED: promise origin 'custody.invalid/audit/"
                                  f"node-6/01020304' is not the log key's name {ORIGIN!r}")
        # The standalone command names the log key too.
        path = self.write(self.note(), "promise")
        out = io.StringIO()
        self.assertEqual(main(["promise", path, "--log-key", other.vkey], out), 1)
        self.assertEqual(out.getvalue(), f"FAILED: promise is not signed by the log key {ORIGIN}\n")

    def test_altered_leaf(self):
        note = self.note()
        good, bad = B64(h_leaf(RECORDS[3])), B64(h_leaf(page_event(3, 12, "acme", "alloc", 41)))
        self.assertIn(good, note)
        self.assert_promise_fails(note.replace(good, bad), f"FAILED: promise: signature by {ORIGIN} "
                                                           f"({self.log.key.key_id:08x}) does not verify")
        # Dropping a record line (and fixing the count) breaks the signature as well.
        lines = note.split("\n")
        del lines[6]
        lines[4] = "4"
        self.assert_promise_fails("\n".join(lines), "does not verify")

    def non_canonical(self):
        leaf = B64(h_leaf(RECORDS[1]))
        head = f"custody.receipt.promise/1\n{ORIGIN}\nreq-5-12\nacme\n"
        cp = checkpoint_text(ORIGIN, 11, mth(self.hashes))
        return [
            (head + f"1\n01 requests {leaf}\n", "promise record 0 seq '01' is not a decimal u64 without leading zeros"),
            (head + f"01\n1 requests {leaf}\n", "promise number of records '01' is not a decimal u64"),
            (head + "-1\n", "promise number of records '-1' is not a decimal u64"),
            (head + f"2\n1 requests {leaf}\n", "promise says 2 records but has 1 record lines"),
            (head + f"0\n1 requests {leaf}\n", "promise says 0 records but has 1 record lines"),
            (head + f"1\n1 requests {leaf}\nextra\n", "promise says 1 records but has 2 record lines"),
            (head + f"1\n1 requests {leaf}\n\n", "promise says 1 records but has 2 record lines"),
            (head + f"1\n1  requests {leaf}\n", "is not '<seq> <table> <leaf>' with single spaces"),
            (head + f"1\n1 requests {leaf} \n", "is not '<seq> <table> <leaf>' with single spaces"),
            (head + f"1\n1 requests {leaf[:-1]}\n", "promise record 0 leaf is not"),
            (head + f"1\n1 requests {B64(b'x' * 31)}\n", "promise record 0 leaf is 31 bytes, not 32"),
            (head + f"2\n3 requests {leaf}\n1 requests {leaf}\n",
             "promise records are not by strictly increasing seq (3, then 1)"),
            (head + f"2\n1 requests {leaf}\n1 requests {leaf}\n", "not by strictly increasing seq (1, then 1)"),
            (head.replace("acme", "ac me") + "0\n", "promise tenant 'ac me' is not a single word"),
            (head.replace("acme", "") + "0\n", "promise tenant '' is not a single word"),
            (head.replace("req-5-12", "req-5-12\u2009") + "0\n",
             "promise request id 'req-5-12\\u2009' is not a single"),
            (head + "1\n1 requ\u00a0ests " + leaf + "\n", "promise record 0 table 'requ\\xa0ests' is not a single"),
            (f"custody.receipt.promise/1\n{ORIGIN}\nreq-5-12\nacme\n", "promise has 4 lines, fewer than the 5"),
            (head.replace("promise/1", "promise/2") + "0\n", "not a receipt promise: its first line is "
                                                             "'custody.receipt.promise/2', not 'custody.receipt"),
            (cp, f"not a receipt promise but a checkpoint (of {ORIGIN}, 11 records)"),
        ]

    def test_non_canonical(self):
        for text, message in self.non_canonical():
            with self.subTest(text=text):
                with self.assertRaises(VerifyError) as e:
                    parse_promise(text)
                self.assertIn(message, str(e.exception))
                # Signed by the log key, it is refused all the same.
                self.assert_promise_fails(self.note(text=text), message)

    def test_missing_final_newline(self):
        text = promise_text(ORIGIN, "req-5-12", "acme", promised([1]))
        with self.assertRaisesRegex(VerifyError, "promise text does not end in a newline"):
            parse_promise(text[:-1])
        # In a note, the text then runs into the signature line: the note has no empty line left.
        self.assert_promise_fails(text[:-1] + "\n" + self.log.line(text[:-1]), "promise note: note has no empty line")
        self.assert_promise_fails("not a note", "promise note: note has no empty line")
        self.assertEqual(parse_promise(text).records[0].seq, 1)

    # --- the receipt does not keep it ------------------------------------------------------

    def test_promise_of_another_request_or_tenant(self):
        self.assert_promise_fails(self.note(GLOBEX, "req-5-13", "globex"),
                                  "FAILED: the promise is of request 'req-5-13', not the receipt's 'req-5-12'",
                                  standalone=False)
        self.assert_promise_fails(self.note(tenant="globex"),
                                  "FAILED: the promise is of tenant 'globex', not the receipt's 'acme'",
                                  standalone=False)
        # An answer that holds only another request's promise.
        globex = self.container(self.entry_of(self.note(GLOBEX, "req-5-13", "globex"), "req-5-13", promised(GLOBEX)))
        self.assert_promise_fails(globex, "FAILED: the answer holds no promise of request req-5-12 (it names: "
                                          "req-5-13)", standalone=False)
        code, out = self.standalone(self.note(GLOBEX, "req-5-13", "globex"), "--request-id", "req-5-12")
        self.assertEqual((code, out), (1, "FAILED: the promise is of request 'req-5-13', not 'req-5-12'\n"))
        # custody_receipt's entry names the receipt's request, its signed note another.
        entry = self.entry_of(self.note(GLOBEX, "req-5-13", "globex"), "req-5-12", promised(GLOBEX))
        self.assert_promise_fails(self.container(entry), "FAILED: custody_receipt lists request 'req-5-12' for a "
                                                         "promise of 'req-5-13'")

    def test_promised_record_missing(self):
        receipt = self.receipt([1, 3, 6, 7])
        self.assert_promise_fails(self.note(), "FAILED: the node promised record 9 (page_events) of req-5-12 in its "
                                               "answer but the receipt lacks it: the log lost or rewrote it",
                                  receipt, standalone=False)
        # A promised seq past the receipt's tree.
        records = promised(ACME) + [(11, "requests", h_leaf(b"later"))]
        self.assert_promise_fails(self.note(records=records), "FAILED: the node promised record 11 (requests) of "
                                  "req-5-12 in its answer but the receipt lacks it: the receipt's tree of 11 records "
                                  "ends before it", standalone=False)

    def test_promised_record_with_another_leaf(self):
        # The node promised the alloc of page 41 at seq 3; the log holds the alloc of page 40 there.
        other = h_leaf(page_event(3, 12, "acme", "alloc", 41))
        records = [(s, t, other if s == 3 else h) for s, t, h in promised(ACME)]
        self.assert_promise_fails(
            self.note(records=records),
            f"FAILED: the node promised record 3 (page_events) of req-5-12 in its answer but the receipt has another "
            f"record there (page_events, leaf {B64(h_leaf(RECORDS[3]))} instead of {B64(other)}): the log lost or "
            "rewrote it", standalone=False)
        # The right leaf under another table's name.
        records = [(s, "requests" if s == 3 else t, h) for s, t, h in promised(ACME)]
        self.assert_promise_fails(self.note(records=records), "FAILED: the node promised record 3 (requests) of "
                                  "req-5-12 in its answer, but the record with its leaf is of table page_events",
                                  standalone=False)

    def test_receipt_checked_first(self):
        receipt = self.receipt()
        receipt["tree_size"] = 10
        code, out = self.with_promise(self.note(), receipt)
        self.assertEqual((code, out), (1, "FAILED: receipt tree_size 10 is not the checkpoint's size 11\n"))
        code, out = self.run_cli(self.receipt(), "--promise", os.path.join(self.tmp.name, "missing"))
        self.assertEqual(code, 1)
        self.assertTrue(out.startswith("FAILED: cannot read promise file "), out)

    # --- custody_receipt ---------------------------------------------------------------------

    def test_error_entry(self):
        error = {"request_id": "req-5-12", "fetch": "/v1/audit/receipt/req-5-12",
                 "error": "the writer's index of recent requests lost part of it"}
        message = ("FAILED: the node made no promise of req-5-12 in its answer: the writer's index of recent "
                   "requests lost part of it")
        self.assert_promise_fails(self.container(error), message)
        self.assert_promise_fails({"custody_receipt": self.container(error)}, message)
        # Standalone, every entry is checked: one error fails it, --request-id picks the other.
        globex = self.entry_of(self.note(GLOBEX, "req-5-13", "globex"), "req-5-13", promised(GLOBEX))
        code, out = self.standalone(self.container(globex, error))
        self.assertEqual((code, out), (1, message + "\n"))
        code, out = self.standalone(self.container(globex, error), "--request-id", "req-5-13")
        self.assertEqual(code, 0, out)

    def test_container_failures(self):
        note = self.note()
        good = self.entry_of(note, records=promised(ACME))
        cases = [
            (dict(self.acme_container(), format="custody-receipt/1"),
             "custody_receipt format is 'custody-receipt/1', not 'custody-receipt-promise/1'"),
            (dict(self.acme_container(), requests={}), "custody_receipt's 'requests' is not a list"),
            (dict(self.acme_container(), node="5"), "custody_receipt's 'node' is not an integer"),
            ({"custody_receipt": []}, "custody_receipt is not a JSON object"),
            (self.container([]), "custody_receipt request 0 is not a JSON object"),
            (self.container({"promise": note}), "custody_receipt request 0 has no 'request_id'"),
            (self.container({"request_id": "req-5-12"}), "custody_receipt request 0 (req-5-12) has no 'promise'"),
            (self.container(dict(good, error="x")), "custody_receipt request 0 (req-5-12) has both an error and"),
            (self.container({"request_id": "req-5-12", "error": None}),
             "request 0 (req-5-12)'s 'error' is not a string"),
            (self.container(dict(good, origin="custody.invalid/audit/node-6/01020304")),
             "custody_receipt lists origin 'custody.invalid/audit/node-6/01020304' for a promise of"),
            (self.container(dict(good, records=good["records"][:-1])),
             "custody_receipt lists other records of req-5-12 than its signed promise names"),
            (self.container(dict(good, records=[dict(good["records"][0], seq=2)] + good["records"][1:])),
             "custody_receipt lists other records of req-5-12 than its signed promise names"),
            (self.container(dict(good, records=[[]])), "custody_receipt record 0 of req-5-12 is not a JSON object"),
            (self.container(good, self.entry_of(self.note([1, 3]), records=promised([1, 3]))),
             "the answer holds 2 different entries of request req-5-12"),
            ({"id": "chatcmpl-1", "usage": {}}, "promise file is JSON with no custody_receipt"),
            ({"custody_receipt": self.container()}, "the answer holds no promise of request req-5-12 (it names: none)"),
        ]
        for promise, message in cases:
            with self.subTest(message=message):
                self.assert_promise_fails(promise, message, standalone=False)
        for text, message in [("{", "promise file is not valid JSON"),
                              ("[1]", "promise file is JSON but not an object"),
                              ("  {\"a\": [}", "promise file is not valid JSON"),
                              ("data: {}\n\ndata: [DONE]\n", "no SSE chunk of the promise file has a custody_receipt"),
                              ("data: {\n", "SSE line 1 is not valid JSON")]:
            with self.subTest(text=text):
                code, out = self.with_promise(text)
                self.assertEqual(code, 1, out)
                self.assertIn(message, out)
        code, out = self.with_promise(b"\xff")
        self.assertEqual((code, out[:39]), (1, "FAILED: promise file is not valid UTF-8"))
        # The listed records are not required beside the note (only held to it when there).
        entry = {"request_id": "req-5-12", "promise": note}
        code, out = self.with_promise(self.container(entry))
        self.assertEqual(code, 0, out)

    def test_python_dash_m(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = self.write(self.note(), "promise")
        run = subprocess.run([sys.executable, "-m", "custody_verify", "promise", path, "--log-key", self.log.vkey],
                             cwd=root, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertTrue(run.stdout.startswith("OK: req-5-12 of tenant acme: 5 records promised by "), run.stdout)
        run = subprocess.run([sys.executable, "-m", "custody_verify", "promise", path], cwd=root,
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 2)
        run = subprocess.run([sys.executable, "-m", "custody_verify", "promise", path, "--log-key", self.log.vkey,
                              "--witness-key", self.w1.vkey], cwd=root, capture_output=True, text=True)
        self.assertEqual(run.returncode, 2)


if __name__ == "__main__":
    unittest.main()
