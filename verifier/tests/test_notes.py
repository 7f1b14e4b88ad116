import base64
import struct
import unittest

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from custody_verify import VerifyError
from custody_verify.notes import (
    ALG_COSIGNATURE_V1,
    ALG_ED25519,
    cosignature_message,
    parse_checkpoint,
    parse_note,
    parse_vkey,
    verify_checkpoint,
    verify_note,
)

from helpers import Signer, checkpoint_text, sign

# Go's golang.org/x/mod/sumdb/note test vector
PN_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
PN_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
PN_TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
PN_LINE = "\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
PN_NOTE = PN_TEXT + "\n" + PN_LINE


def pn_signer() -> Signer:
    # PRIVATE+KEY+<name>+<id>+<base64>: the base64 itself holds a "+", so split 4 times
    raw = base64.b64decode(PN_SKEY.split("+", 4)[4])
    assert raw[0] == 0x01
    return Signer("PeterNeumann", ALG_ED25519, Ed25519PrivateKey.from_private_bytes(raw[1:]))


class VkeyTest(unittest.TestCase):
    def test_parse(self):
        k = parse_vkey(PN_VKEY)
        self.assertEqual((k.name, k.key_id, k.alg, len(k.public_key)), ("PeterNeumann", 0xC74F20A3, 1, 32))
        self.assertEqual(str(k), PN_VKEY)

    def test_private_key_matches(self):
        self.assertEqual(pn_signer().vkey, PN_VKEY)

    def test_bad(self):
        for bad in [
            "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong id
            "PeterNeumann+c74f20a+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # 7 digits
            "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
            "PeterNeumann+c74f20a3",
            "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10T",  # bad base64
            "PeterNeumann+c74f20a3+Ahpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # type 0x02
            "+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
        ]:
            with self.subTest(vkey=bad), self.assertRaises(VerifyError):
                parse_vkey(bad)


class NoteTest(unittest.TestCase):
    def test_exact_signature_from_seed(self):
        self.assertEqual(pn_signer().line(PN_TEXT), PN_LINE)

    def test_verify(self):
        note = parse_note(PN_NOTE.encode())
        self.assertEqual(note.text, PN_TEXT)
        (v,) = verify_note(note, [parse_vkey(PN_VKEY)])
        self.assertEqual(v.key.name, "PeterNeumann")

    def test_altered_text_fails(self):
        note = parse_note(PN_NOTE.replace("problem,", "problem;"))
        with self.assertRaisesRegex(VerifyError, "does not verify"):
            verify_note(note, [parse_vkey(PN_VKEY)])

    def test_unknown_keys_ignored_known_bad_fails(self):
        other = Signer("other.example", ALG_ED25519)
        same_name = Signer("PeterNeumann", ALG_ED25519)  # same name, other id: unknown
        note = parse_note(PN_TEXT + "\n" + other.line(PN_TEXT) + same_name.line("x\n") + PN_LINE)
        self.assertEqual(len(verify_note(note, [parse_vkey(PN_VKEY)])), 1)
        with self.assertRaisesRegex(VerifyError, "no signature from a known key"):
            verify_note(note, [Signer("nobody", ALG_ED25519).key])
        bad = other.line("something else\n")
        with self.assertRaisesRegex(VerifyError, "other.example"):
            verify_note(parse_note(PN_TEXT + "\n" + PN_LINE + bad), [parse_vkey(PN_VKEY), other.key])

    def test_malformed(self):
        for bad in [
            PN_TEXT + PN_LINE,  # no blank line
            PN_TEXT + "\n",  # no signatures
            PN_NOTE[:-1],  # no final newline
            PN_NOTE.replace("\u2014", "-"),
            PN_NOTE.replace("\u2014 PeterNeumann ", "\u2014 PeterNeumann"),
            PN_NOTE.replace("If you", "If\tyou"),
            PN_NOTE.replace("If you", "If\ryou"),
            PN_TEXT + "\n" + "\u2014 a AAAA\n",  # signature shorter than 5 bytes
            PN_TEXT + "\n" + PN_LINE * 101,
        ]:
            with self.subTest(note=bad[-60:]), self.assertRaises(VerifyError):
                parse_note(bad)
        with self.assertRaisesRegex(VerifyError, "UTF-8"):
            parse_note(b"\xff\n\n" + PN_LINE.encode())
        with self.assertRaisesRegex(VerifyError, "larger"):
            parse_note(b"a" * 1_000_001)

    def test_text_may_hold_empty_lines(self):
        text = "one\n\ntwo\n"
        s = Signer("k", ALG_ED25519)
        note = parse_note(sign(text, s.line(text)))
        self.assertEqual(note.text, text)
        verify_note(note, [s.key])


ROOT = bytes(range(32))


class CheckpointTest(unittest.TestCase):
    def setUp(self):
        self.log = Signer("example.com/log", ALG_ED25519)
        self.w1 = Signer("witness1.example", ALG_COSIGNATURE_V1)
        self.w2 = Signer("witness2.example", ALG_COSIGNATURE_V1)
        self.text = checkpoint_text("example.com/log", 42, ROOT)

    def test_parse(self):
        cp = parse_checkpoint(self.text + "ext line\n")
        self.assertEqual((cp.origin, cp.size, cp.root, cp.extensions), ("example.com/log", 42, ROOT, ["ext line"]))
        for bad in ["a\n01\n" + self.text.split("\n")[2] + "\n", "a\n1\n", "\n1\nAAAA\n",
                    "a\n1\nAAAA\n", self.text + "\n", "a\n-1\n" + self.text.split("\n")[2] + "\n"]:
            with self.subTest(text=bad), self.assertRaises(VerifyError):
                parse_checkpoint(bad)

    def test_cosignature(self):
        note = sign(self.text, self.log.line(self.text), self.w1.line(self.text, 1_700_000_123))
        v = verify_checkpoint(note, self.log.key, [self.w1.key], 1)
        self.assertEqual(v.checkpoint.size, 42)
        self.assertEqual([(c.key.name, c.timestamp) for c in v.cosignatures], [("witness1.example", 1_700_000_123)])

    def test_cosignature_message(self):
        self.assertEqual(cosignature_message("o\n1\nAA==\n", 7), b"cosignature/v1\ntime 7\no\n1\nAA==\n")

    def test_altered_timestamp_fails(self):
        line = self.w1.line(self.text, 1_700_000_123)
        raw = bytearray(base64.b64decode(line.split(" ")[2]))
        raw[4:12] = struct.pack(">Q", 1_700_000_124)
        forged = f"\u2014 witness1.example {base64.b64encode(bytes(raw)).decode()}\n"
        with self.assertRaisesRegex(VerifyError, "witness1.example"):
            verify_checkpoint(sign(self.text, self.log.line(self.text), forged), self.log.key, [self.w1.key], 1)

    def test_zero_timestamp_fails(self):
        line = self.w1.line(self.text, 0)
        with self.assertRaisesRegex(VerifyError, "timestamp 0"):
            verify_checkpoint(sign(self.text, self.log.line(self.text), line), self.log.key, [self.w1.key])

    def test_altered_text_fails(self):
        other = checkpoint_text("example.com/log", 43, ROOT)
        note = sign(self.text, self.log.line(self.text), self.w1.line(other))
        with self.assertRaisesRegex(VerifyError, "witness1.example"):
            verify_checkpoint(note, self.log.key, [self.w1.key])
        with self.assertRaisesRegex(VerifyError, "example.com/log .* does not verify"):
            verify_checkpoint(sign(other, self.log.line(self.text)), self.log.key)

    def test_ed25519_key_is_not_a_witness_key(self):
        plain = Signer("witness1.example", ALG_ED25519)
        note = sign(self.text, self.log.line(self.text), plain.line(self.text))
        with self.assertRaisesRegex(VerifyError, "not 0x04"):
            verify_checkpoint(note, self.log.key, [plain.key], 1)
        with self.assertRaisesRegex(VerifyError, "not 0x01"):
            verify_checkpoint(note, self.w1.key)

    def test_witness_count(self):
        note = sign(self.text, self.log.line(self.text), self.w1.line(self.text), self.w1.line(self.text, 5))
        verify_checkpoint(note, self.log.key, [self.w1.key, self.w2.key], 1)
        with self.assertRaisesRegex(VerifyError, "1 witness cosignature"):
            verify_checkpoint(note, self.log.key, [self.w1.key, self.w2.key], 2)
        alias = Signer("alias.example", ALG_COSIGNATURE_V1, self.w1.private)  # same key, other name
        note = sign(self.text, self.log.line(self.text), self.w1.line(self.text), alias.line(self.text))
        with self.assertRaisesRegex(VerifyError, "1 witness cosignature"):
            verify_checkpoint(note, self.log.key, [self.w1.key, alias.key], 2)

    def test_origin_must_be_log_key_name(self):
        other = Signer("example.com/other", ALG_ED25519)
        with self.assertRaisesRegex(VerifyError, "origin"):
            verify_checkpoint(sign(self.text, other.line(self.text)), other.key)

    def test_log_signature_required(self):
        note = sign(self.text, self.w1.line(self.text))
        with self.assertRaisesRegex(VerifyError, "not signed by the log key"):
            verify_checkpoint(note, self.log.key, [self.w1.key])


if __name__ == "__main__":
    unittest.main()
