#!/usr/bin/env python3
"""`custody forensics exposure --format csv` output against `custody audit synth`'s ground truth.

    scripts/check-exposure-truth.py ROOT/synth-truth.json EXPOSURE.csv

Prints the log's size and whether the affected responses, their source tenants and the foreign
slot counts equal the injected truth; exit code 0 when they do, 1 otherwise.
"""
import json
import sys

truth = json.load(open(sys.argv[1]))
want = {(e["node"], e["request"]): (e["recipient_tenant"], sorted(map(tuple, e["sources"])))
        for e in truth["exposures"]}
got = {}
for line in open(sys.argv[2]):
    p = line.strip().split(",")
    if len(p) == 8 and p[0].isdigit():
        got.setdefault((int(p[0]), int(p[1])), (p[2], []))[1].append((p[3], int(p[4])))
got = {k: (v[0], sorted(v[1])) for k, v in got.items()}
ok = got == want
print(f"log: {truth['events']} events, {truth['requests']} requests; prefix cache: "
      f"{truth.get('cache_shares', 0)} page shares, {truth.get('cache_hits', 0)} page hits "
      f"({truth.get('cache_public_cross_tenant_hits', 0)} across tenants in a public scope)")
print(f"ground truth: {len(want)} exposures (injected and fault-rate), {len(got)} found, "
      f"{'EQUAL' if ok else 'DIFFERENT'} (responses, tenant pairs, foreign-slot counts)")
sys.exit(0 if ok else 1)
