import struct
import unittest

from custody_verify import VerifyError
from custody_verify.records import (
    TAG_I32,
    TAG_I64,
    TAG_NULL,
    TAG_U32,
    TAG_U64,
    TAG_UTF8,
    LostRecord,
    Record,
    decode_record,
)

from helpers import encode_lost, encode_record

COLUMNS = [
    ("node_id", "u32", 3),
    ("seq", "u64", 2**64 - 1),
    ("ts_ns", "u64", 123456789),
    ("wall_ns", "i64", -1_700_000_000_000_000_000),
    ("request_id", "u64", 0),
    ("tenant", "utf8", "t\u00e9nant \u2603 \"q\""),
    ("event", "utf8", ""),
    ("reason", "null", None),
    ("penalty_milli", "i32", -2**31),
    ("prompt_tokens", "u32", 2**32 - 1),
]


class RecordTest(unittest.TestCase):
    def test_round_trip(self):
        data = encode_record("requests", COLUMNS)
        self.assertEqual(data[:23], b"custody.audit.record/1\x00")
        self.assertEqual(data[23:32], b"\x08requests")
        self.assertEqual(data[32:34], b"\x00\x0a")
        self.assertEqual(data[34:43], b"\x07node_id\x01")
        rec = decode_record(data)
        self.assertEqual(rec, Record("requests", [(n, v) for n, _, v in COLUMNS]))
        self.assertIsNone(rec.get("reason"))
        self.assertEqual(rec.get("wall_ns"), -1_700_000_000_000_000_000)

    def test_minimal_record(self):
        rec = decode_record(encode_record("writer_events", [("seq", "u64", 9)]))
        self.assertEqual(rec, Record("writer_events", [("seq", 9)]))
        self.assertEqual(rec.tag("seq"), TAG_U64)
        self.assertIsNone(rec.tag("tenant"))

    def test_tags(self):
        rec = decode_record(encode_record("requests", COLUMNS))
        self.assertEqual(rec.tags, [TAG_U32, TAG_U64, TAG_U64, TAG_I64, TAG_U64, TAG_UTF8, TAG_UTF8, TAG_NULL,
                                    TAG_I32, TAG_U32])
        self.assertEqual(rec.tag("tenant"), TAG_UTF8)

    def test_seq_column_required(self):
        with self.assertRaisesRegex(VerifyError, "^record of table 'writer_events' has no seq column$"):
            decode_record(encode_record("writer_events", []))
        with self.assertRaisesRegex(VerifyError, "no seq column"):
            decode_record(encode_record("requests", [c for c in COLUMNS if c[0] != "seq"]))
        for kind, value in [("u32", 3), ("i64", 3), ("utf8", "3"), ("null", None)]:
            with self.subTest(kind=kind), self.assertRaisesRegex(VerifyError, f"seq column of type {kind}, not u64"):
                decode_record(encode_record("requests", [("seq", kind, value)]))

    def test_names(self):
        with self.assertRaisesRegex(VerifyError, "empty table name"):
            decode_record(encode_record("", [("seq", "u64", 1)]))
        with self.assertRaisesRegex(VerifyError, "column 1 has an empty name"):
            decode_record(encode_record("t", [("seq", "u64", 1), ("", "null", None)]))
        with self.assertRaisesRegex(VerifyError, "has column 'tenant' twice"):
            decode_record(encode_record("t", [("seq", "u64", 1), ("tenant", "utf8", "a"), ("tenant", "utf8", "b")]))
        with self.assertRaisesRegex(VerifyError, "has column 'seq' twice"):
            decode_record(encode_record("t", [("seq", "u64", 1), ("seq", "u64", 1)]))

    def test_lost(self):
        data = encode_lost(7, 2**40 + 5)
        self.assertEqual(data, b"custody.audit.lost/1\x00" + b"\x00\x00\x00\x07" + struct.pack(">Q", 2**40 + 5))
        self.assertEqual(decode_record(data), LostRecord(7, 2**40 + 5))
        for bad in [data[:-1], data + b"\x00"]:
            with self.assertRaises(VerifyError):
                decode_record(bad)

    def test_truncation_anywhere_fails(self):
        data = encode_record("requests", COLUMNS)
        for n in range(len(data)):
            with self.subTest(length=n), self.assertRaises(VerifyError):
                decode_record(data[:n])

    def test_trailing_bytes(self):
        with self.assertRaisesRegex(VerifyError, "trailing"):
            decode_record(encode_record("requests", COLUMNS) + b"\x00")

    def test_unknown_tag(self):
        data = encode_record("t", [("a", "null", None)])
        with self.assertRaisesRegex(VerifyError, "unknown tag 6"):
            decode_record(data[:-1] + b"\x06")

    def test_bad_utf8(self):
        good = encode_record("t", [("a", "utf8", "xy")])
        with self.assertRaisesRegex(VerifyError, "UTF-8"):
            decode_record(good[:-2] + b"\xc3\x28")
        with self.assertRaisesRegex(VerifyError, "UTF-8"):
            decode_record(encode_record("t", [])[:-4] + b"\x01\xff\x00\x00")
        with self.assertRaisesRegex(VerifyError, "UTF-8"):
            decode_record(encode_record("t\xe9", [("seq", "u64", 1)]).replace(b"t\xc3\xa9", b"t\xc3\x28"))

    def test_bad_magic(self):
        for bad in [b"", b"custody.audit.record/2\x00\x00\x00\x00", b"{}"]:
            with self.assertRaisesRegex(VerifyError, "prefix"):
                decode_record(bad)


if __name__ == "__main__":
    unittest.main()
