"""A multi-tenant load through the official `openai` client against a fleet's router
(tests/tests/e2e/fleet.rs).

Usage: fleet_load.py JOBS.json. Environment: CUSTODY_URL (http://host:port), CUSTODY_KEYS (one
API key per tenant, comma-separated), CUSTODY_MODEL_ID, CUSTODY_CONCURRENCY.

Each job is {"job": k, "tenant": i, "prompt": [token ids], "max_tokens": n}. One
JSON line per finished job, as it finishes: {"job", "status": "ok", "tokens", "request_id",
"finish"} or {"job", "status": "error", "http" (status code, or null when the connection
failed), "error" (the server's error object or the exception)}. No retries in the client: every
failure the fleet could not absorb must show here.
"""
import concurrent.futures
import json
import os
import sys
import threading

import openai
from openai import OpenAI

URL = os.environ["CUSTODY_URL"]
KEYS = os.environ["CUSTODY_KEYS"].split(",")
MODEL = os.environ["CUSTODY_MODEL_ID"]
CONCURRENCY = int(os.environ.get("CUSTODY_CONCURRENCY", "4"))

clients = [OpenAI(base_url=URL + "/v1", api_key=k, max_retries=0, timeout=300) for k in KEYS]
out_lock = threading.Lock()


def emit(obj):
    with out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def run_whole(c, job):
    raw = c.completions.with_raw_response.create(
        model=MODEL,
        prompt=job["prompt"],
        max_tokens=job["max_tokens"],
        temperature=0,
        extra_body={"custody_token_ids": True},
    )
    body = raw.http_response.json()
    choice = body["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "finish": choice["finish_reason"],
        "request_id": raw.headers.get("x-request-id"),
    }


def run(job):
    c = clients[job["tenant"] % len(clients)]
    try:
        r = run_whole(c, job)
        emit({"job": job["job"], "status": "ok", **r})
    except openai.APIStatusError as e:
        emit({"job": job["job"], "status": "error", "http": e.status_code, "error": e.body})
    except openai.APIError as e:
        # A connection that failed.
        emit({"job": job["job"], "status": "error", "http": None, "error": str(e)})


def main():
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    with concurrent.futures.ThreadPoolExecutor(max_workers=CONCURRENCY) as ex:
        list(ex.map(run, jobs))


if __name__ == "__main__":
    main()
