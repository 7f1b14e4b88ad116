"""custody-verify: check Custody audit-log inclusion and consistency proofs, receipts and the
promises answers make of them, and per-tenant incident notices, offline.

Exit status: 0 verified, 1 verification failed (or an input could not be read), 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import List, Optional, Sequence, TextIO, Union

from . import VerifyError, __version__
from .notes import VerifiedSignature, VerifierKey, parse_vkey
from .notice import NoticeResult, default_sig_path, verify_notice
from .promise import PromiseCheck, read_promises, select_promises, verify_entry, verify_receipt_promise
from .proofs import verify_consistency_proof, verify_tlog_proof
from .receipt import verify_receipt
from .records import LostRecord, Record, Value, decode_record


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise VerifyError(f"cannot read {what} {path}: {e.strerror or e}") from e


def _log_key(args: argparse.Namespace) -> VerifierKey:
    if args.log_key_file:
        return parse_vkey(_read(args.log_key_file, "log key file").decode("utf-8", "replace").strip())
    return parse_vkey(args.log_key)


def _witness_policy(args: argparse.Namespace) -> tuple:
    keys = [parse_vkey(k) for k in args.witness_key]
    need = args.min_witnesses if args.min_witnesses is not None else len(keys)
    if need < 0:
        raise VerifyError("--min-witnesses must not be negative")
    return keys, need


def _format_value(value: Value) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _print_witnesses(cosigs: Sequence[VerifiedSignature], out: TextIO, indent: str = "") -> None:
    for c in cosigs:
        ts = c.timestamp or 0
        try:
            when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        except (OverflowError, OSError, ValueError):
            when = "out of range"
        print(f"{indent}cosigned by {c.key.name} at {when} ({ts})", file=out)


def print_record(record: Union[Record, LostRecord], out: TextIO) -> None:
    if isinstance(record, LostRecord):
        print(f"lost record: node {record.node}, seq {record.seq} (it never reached disk)", file=out)
        return
    print(f"table {record.table}:", file=out)
    for name, value in record.columns:
        print(f"  {name} = {_format_value(value)}", file=out)


def _cmd_proof(args: argparse.Namespace, out: TextIO) -> None:
    witnesses, need = _witness_policy(args)
    result = verify_tlog_proof(_read(args.proof_file, "proof file"), _log_key(args), witnesses, need)
    cp = result.verified.checkpoint
    print(f"OK: record {result.index} of {cp.origin} (tree of {cp.size} records, root {cp.root.hex()})", file=out)
    _print_witnesses(result.verified.cosignatures, out)
    print_record(result.record, out)


def _cmd_consistency(args: argparse.Namespace, out: TextIO) -> None:
    witnesses, need = _witness_policy(args)
    result = verify_consistency_proof(
        _read(args.proof_file, "proof file"),
        _read(args.old_checkpoint, "old checkpoint"),
        _log_key(args),
        witnesses,
        need,
    )
    old, new = result.old.checkpoint, result.new.checkpoint
    print(f"OK: the tree of {new.size} records of {new.origin} extends the one of {old.size}", file=out)
    _print_witnesses(result.new.cosignatures, out)


_RECEIPT_SKIPPED = ("node_id", "seq", "ts_ns")


def _print_promise_kept(check: PromiseCheck, out: TextIO) -> None:
    print(f"promise kept: the {len(check.promise.records)} records promised in the answer are in the log, "
          "unchanged", file=out)
    if check.after:
        listed = ", ".join(f"seq {r.seq} ({r.record.table})" for r in check.after)
        print(f"{len(check.after)} recorded after the answer (not in the promise): {listed}", file=out)


def _cmd_receipt(args: argparse.Namespace, out: TextIO) -> None:
    witnesses, need = _witness_policy(args)
    log_key = _log_key(args)
    result = verify_receipt(_read(args.receipt_file, "receipt"), log_key, witnesses, need)
    check = None
    if args.promise:
        check = verify_receipt_promise(_read(args.promise, "promise file"), log_key, result)
    cp = result.verified.checkpoint
    print(f"OK: {result.request_id} of tenant {result.tenant}: {len(result.records)} records "
          f"in the tree of {cp.size} records of {cp.origin}", file=out)
    _print_witnesses(result.verified.cosignatures, out)
    for r in result.records:
        cols = " ".join(f"{name}={_format_value(value)}" for name, value in r.record.columns
                        if name not in _RECEIPT_SKIPPED)
        print(f"  seq {r.seq} {r.record.table}: {cols}".rstrip(), file=out)
    if check is not None:
        _print_promise_kept(check, out)


def _cmd_promise(args: argparse.Namespace, out: TextIO) -> None:
    log_key = _log_key(args)
    entries = select_promises(read_promises(_read(args.file, "promise file")), args.request_id)
    promises = [verify_entry(e, log_key) for e in entries]
    for p in promises:
        if args.request_id is not None and p.request_id != args.request_id:
            raise VerifyError(f"the promise is of request {p.request_id!r}, not {args.request_id!r}")
    for p in promises:
        print(f"OK: {p.request_id} of tenant {p.tenant}: {len(p.records)} records promised by {p.origin}", file=out)
        for r in p.records:
            print(f"  seq {r.seq} {r.table} {r.leaf_b64}", file=out)


def _key_file_lines(path: str) -> List[str]:
    text = _read(path, "key file").decode("utf-8", "replace")
    keys = [line.strip() for line in text.splitlines() if line.strip()]
    if not keys:
        raise VerifyError(f"key file {path} holds no key")
    return keys


def _print_notice(result: NoticeResult, out: TextIO) -> None:
    verdict = "EXPOSED" if result.exposed else "not exposed"
    print(f"OK: notice for tenant {result.tenant}: {verdict}", file=out)
    if result.summary is not None:
        print(result.summary, file=out)
    if result.window is not None:
        w = result.window
        print(f"window (wall-clock ns): {_format_value(w.get('from_wall_ns'))} to "
              f"{_format_value(w.get('to_wall_ns'))}", file=out)
    checked = [e for e in result.entries if e.receipt is not None]
    print(f"{len(checked)} receipt(s) checked", file=out)
    for e in checked:
        cp = e.receipt.verified.checkpoint
        print(f"  {e.side} {e.request_id} (node {e.node}): {len(e.receipt.records)} records in the tree of "
              f"{cp.size} records of {cp.origin}", file=out)
    for e in result.entries:
        if e.missing is not None:
            print(f"receipt missing: {e.side} {e.request_id} (node {e.node}): {e.missing}", file=out)
    if result.truncated:
        print("truncated: the notice lists only part of the requests found", file=out)
    for log in result.logs:
        head = f"node {log.node}: the tree of {log.tree_size} records of {log.origin}"
        if log.old_size == 0:
            print(f"{head} (nothing was sealed before the window)", file=out)
        elif log.old_size == log.tree_size:
            print(f"{head} is the tree at the window's start (no record since)", file=out)
        else:
            print(f"{head} extends the one of {log.old_size} (consistency proved)", file=out)
        _print_witnesses(log.verified.cosignatures, out, "  ")


def _cmd_notice(args: argparse.Namespace, out: TextIO) -> None:
    witnesses, need = _witness_policy(args)
    if args.notice_key_file:
        notice_keys = _key_file_lines(args.notice_key_file)
        if len(notice_keys) != 1:
            raise VerifyError(f"notice key file {args.notice_key_file} holds {len(notice_keys)} keys, not one")
        notice_key = parse_vkey(notice_keys[0])
    else:
        notice_key = parse_vkey(args.notice_key)
    log_keys = [parse_vkey(k) for k in args.log_key]
    for path in args.log_key_file:
        log_keys += [parse_vkey(k) for k in _key_file_lines(path)]
    data = _read(args.notice_file, "notice")
    sig_path = args.sig if args.sig is not None else default_sig_path(args.notice_file)
    sig = _read(sig_path, "notice signature")
    _print_notice(verify_notice(data, sig, notice_key, log_keys, witnesses, need), out)


def _cmd_record(args: argparse.Namespace, out: TextIO) -> None:
    print_record(decode_record(_read(args.file, "record file")), out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="custody-verify", description="Verify Custody audit-log transparency proofs.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def log_key(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--log-key", metavar="VKEY", help="the log's verifier key (type 0x01), named as the origin")
        g.add_argument("--log-key-file", metavar="FILE", help="a file holding the log's verifier key")

    def keys(sp: argparse.ArgumentParser) -> None:
        log_key(sp)
        sp.add_argument("--witness-key", metavar="VKEY", action="append", default=[],
                        help="a witness's cosignature verifier key (type 0x04); repeatable")
        sp.add_argument("--min-witnesses", metavar="N", type=int, default=None,
                        help="witness cosignatures required (default: every --witness-key)")

    sp = sub.add_parser("proof", help="check a c2sp.org/tlog-proof@v1 inclusion proof of one record")
    sp.add_argument("proof_file", metavar="PROOF_FILE")
    keys(sp)
    sp.set_defaults(run=_cmd_proof)

    sp = sub.add_parser("consistency", help="check that a new checkpoint extends an older one")
    sp.add_argument("proof_file", metavar="PROOF_FILE")
    sp.add_argument("--old-checkpoint", metavar="NOTE_FILE", required=True, help="the older signed checkpoint")
    keys(sp)
    sp.set_defaults(run=_cmd_consistency)

    sp = sub.add_parser("receipt", help="check a custody-receipt/1: every record of one request, proven")
    sp.add_argument("receipt_file", metavar="RECEIPT.json")
    keys(sp)
    sp.add_argument("--promise", metavar="FILE", help="also hold the receipt to the promise the answer made "
                    "(the answer's JSON, an SSE chunk, the custody_receipt object, or the signed note)")
    sp.set_defaults(run=_cmd_receipt)

    sp = sub.add_parser("promise", help="check the signed promise of a request's records an answer carries")
    sp.add_argument("file", metavar="FILE", help="the answer's JSON, an SSE chunk, the custody_receipt object, "
                    "or the signed note")
    log_key(sp)
    sp.add_argument("--request-id", metavar="ID", help="only the promise of this request (default: every one)")
    sp.set_defaults(run=_cmd_promise)

    sp = sub.add_parser("notice", help="check a custody-notice/1: a tenant's signed incident notice, its "
                        "receipts and the logs' consistency proofs")
    sp.add_argument("notice_file", metavar="NOTICE.json")
    sp.add_argument("--sig", metavar="FILE", help="the notice's signed note (default: the notice's path with "
                    ".json replaced by .sig)")
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--notice-key", metavar="VKEY", help="the notice key's verifier key (type 0x01)")
    g.add_argument("--notice-key-file", metavar="FILE", help="a file holding it (notices.vkey)")
    sp.add_argument("--log-key", metavar="VKEY", action="append", default=[],
                    help="a node log's verifier key (type 0x01), named as its origin; one per origin, repeatable")
    sp.add_argument("--log-key-file", metavar="FILE", action="append", default=[],
                    help="a file of log verifier keys, one a line; repeatable")
    sp.add_argument("--witness-key", metavar="VKEY", action="append", default=[],
                    help="a witness's cosignature verifier key (type 0x04); repeatable")
    sp.add_argument("--min-witnesses", metavar="N", type=int, default=None,
                    help="witness cosignatures required of every checkpoint (default: every --witness-key)")
    sp.set_defaults(run=_cmd_notice)

    sp = sub.add_parser("record", help="decode a record's canonical bytes")
    sp.add_argument("file", metavar="FILE")
    sp.set_defaults(run=_cmd_record)
    return p


def main(argv: Optional[List[str]] = None, out: Optional[TextIO] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "notice" and not args.log_key and not args.log_key_file:
        parser.error("notice: at least one --log-key (or --log-key-file) is required")
    out = out or sys.stdout
    try:
        args.run(args, out)
    except VerifyError as e:
        print(f"FAILED: {e}", file=out)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
