#!/usr/bin/env python3
"""The exposure question, answered by DuckDB over the same audit root: an independent engine
running the same SQL (`EXPOSURE_PREPARE_SQL`, then `EXPOSURE_SQL`, in query/src/forensics.rs, read
from the source as is) on the same sealed Parquet files.

    pip install duckdb
    scripts/duckdb-exposure.py <audit-root> [--threads N] [--memory-limit 8GB] [--no-hash-check]

Files: only those a digest under `<root>/_digests/` names, each checked against the SHA-256 the
digest records (unless --no-hash-check). The digests' Ed25519 signatures and the chain are not
checked here: run `custody audit verify <root>` for that. The live (unsealed) segment is not
read. Prints the affected rows and the same summary as `custody forensics exposure`, and the
query's wall time.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import time

import duckdb

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = ["page_events", "page_reads", "integrity_violations", "prefix_cache", "kv_offload"]
# Columns the exposure SQL reads from a table the log does not have (an empty view stands in).
EMPTY_COLUMNS = {
    "prefix_cache": "NULL::UINTEGER AS node_id, NULL::UBIGINT AS seq, NULL::UBIGINT AS request_id, "
    "NULL::VARCHAR AS event, NULL::UINTEGER AS page, NULL::UINTEGER AS generation, "
    "NULL::VARCHAR AS namespace, NULL::VARCHAR AS scope_kind",
    "kv_offload": "NULL::UINTEGER AS node_id, NULL::UBIGINT AS seq, NULL::UBIGINT AS request_id, "
    "NULL::VARCHAR AS event, NULL::UINTEGER AS page, NULL::UINTEGER AS generation, "
    "NULL::VARCHAR AS namespace, NULL::VARCHAR AS scope, NULL::UBIGINT AS writer_request_id",
}
PREVENTED_SQL = "SELECT COUNT(*) FROM all_integrity_violations"


def exposure_sql():
    """(EXPOSURE_PREPARE_SQL, EXPOSURE_SQL) exactly as custody runs them, with the time window
    left open."""
    src = open(os.path.join(REPO, "query", "src", "forensics.rs"), encoding="utf-8").read()
    # A query is one raw string literal, or `concat!` of a macro's literal (the CTE it shares
    # with another query, `macro_rules! NAME { () => { r#"..."# }; }`) and its own.
    macros = {
        m.group(1): m.group(2)
        for m in re.finditer(
            r'macro_rules! (\w+) \{\s*\(\) => \{\s*r#"(.*?)"#\s*\};\s*\}', src, re.S
        )
    }
    out = []
    for name in ("EXPOSURE_PREPARE_SQL", "EXPOSURE_SQL"):
        m = re.search(r"pub const " + name + r': &str = r#"(.*?)"#;', src, re.S)
        if m:
            sql = m.group(1)
        else:
            m = re.search(
                r"pub const " + name + r': &str = concat!\(\s*(\w+)!\(\),\s*r#"(.*?)"#\s*\);',
                src,
                re.S,
            )
            if not m or m.group(1) not in macros:
                sys.exit(f"{name} not found in query/src/forensics.rs")
            sql = macros[m.group(1)] + m.group(2)
        out.append(sql.replace("{from_ns}", str(-(2**63))).replace("{to_ns}", str(2**63 - 1)))
    return out


def sealed_files(root, check_hashes):
    """{table: [path]} for every file a digest names (hash-checked)."""
    files = {}
    digests = sorted(glob.glob(os.path.join(root, "_digests", "node=*", "*.json")))
    if not digests:
        sys.exit(f"no digests under {root}/_digests: not an audit root?")
    for d in digests:
        body = json.load(open(d, encoding="utf-8"))
        for f in body["files"]:
            path = os.path.join(root, f["path"])
            if check_hashes:
                h = hashlib.sha256()
                with open(path, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                if h.hexdigest() != f["sha256"]:
                    sys.exit(f"{path}: SHA-256 differs from its digest {d}")
            files.setdefault(f["table"], []).append(path)
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--memory-limit", default=None, help="DuckDB memory_limit, e.g. 8GB")
    ap.add_argument("--no-hash-check", action="store_true")
    a = ap.parse_args()

    t0 = time.monotonic()
    files = sealed_files(a.root, not a.no_hash_check)
    t_files = time.monotonic() - t0
    con = duckdb.connect()
    con.execute(f"SET threads = {int(a.threads)}")
    if a.memory_limit:
        con.execute(f"SET memory_limit = '{a.memory_limit}'")
    for t in TABLES:
        if t in files:
            lst = ", ".join("'" + p.replace("'", "''") + "'" for p in files[t])
            # The Hive partition columns (node=, date=) are in the paths; the files carry node_id.
            con.execute(f"CREATE VIEW all_{t} AS SELECT * FROM read_parquet([{lst}])")
        else:
            cols = EMPTY_COLUMNS.get(t, "NULL::UINTEGER AS node_id, NULL::UBIGINT AS seq")
            con.execute(f"CREATE VIEW all_{t} AS SELECT {cols} WHERE FALSE")
    t1 = time.monotonic()
    prepare, query = exposure_sql()
    con.execute(prepare)
    rows = con.execute(query).fetchall()
    t_query = time.monotonic() - t1
    prevented = con.execute(PREVENTED_SQL).fetchone()[0] if "integrity_violations" in files else 0

    print("# affected responses (one row per response and source tenant)")
    print("node_id,request_id,recipient_tenant,source_tenant,foreign_slots,wall_ns,unchecked,last_wall_ns")
    affected = {}
    for node, req, rt, st, n, wall, unchecked, last_wall in rows:
        print(f"{node},{req},{rt},{st},{n},{wall},{unchecked},{last_wall}")
        a_ = affected.setdefault(
            (node, req), {"tenant": rt, "slots": 0, "first": wall, "last": last_wall, "sources": set()}
        )
        a_["slots"] += n
        a_["first"] = min(a_["first"], wall)
        a_["last"] = max(a_["last"], last_wall)
        a_["sources"].add(st)
    firsts = [v["first"] for v in affected.values()]
    lasts = [v["last"] for v in affected.values()]
    print("# summary")
    print(f"affected responses: {len(affected)}")
    print(
        "distinct source tenants (whose data was exposed): "
        f"{len(set().union(*[v['sources'] for v in affected.values()]) if affected else set())}"
    )
    print(f"distinct recipient tenants (who received it): {len({v['tenant'] for v in affected.values()})}")
    print(f"max foreign slots in one reply: {max((v['slots'] for v in affected.values()), default=0)}")
    print(f"first occurrence (wall ns): {min(firsts, default=0)}")
    print(f"last occurrence (wall ns): {max(lasts, default=0)}")
    print(f"prevented exposures (reads refused by the tag check): {prevented}")
    sys.stdout.flush()
    print(
        f"# duckdb {duckdb.__version__}, {a.threads} threads: file list + hash check "
        f"{t_files:.2f} s, exposure query {t_query:.2f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
