#!/usr/bin/env python3
"""The slowest requests of a run, beside what kvlb estimated when it chose their replica.

Reads either a `kvlb serve --access-log` file (one JSON line per request: first_byte_ms,
estimate_ms, wait_ms, runner_up_ms, matched_tokens, spilled, replica) or a `kvlb simulate
--decisions` file (ttft_s, estimate_s, wait_s, runner_up_s, matched_tokens, cached_tokens, the
engines' queues at arrival; --policy picks one policy's lines). Prints the slowest PERCENT of
the requests one per line, then per replica how far observed times were from the estimates
(median and p90 of observed / estimated) and how many of the slowest requests it served.

    python3 bench/tail.py /tmp/kvlb-logs/mixed/kvlb.r1.jsonl
    kvlb simulate --trace gen:agent-sessions --speeds 1,1,0.333,0.333 --policies cache_aware \\
        --decisions d.jsonl && python3 bench/tail.py d.jsonl --percent 1
"""

import argparse
import json
import sys


def rows(path, policy):
    """(kind, requests): each request as a dict of common fields, times in seconds."""
    out = []
    kind = None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "first_byte_ms" in r:
                kind = "access log"
                if r.get("first_byte_ms") is None or r.get("estimate_ms") is None:
                    continue
                out.append({
                    "at": r["time"],
                    "replica": r["replica"],
                    "reason": r.get("reason"),
                    "prompt": r.get("prompt_tokens"),
                    "matched": r.get("matched_tokens"),
                    "cached": None,
                    "ttft": r["first_byte_ms"] / 1e3,
                    "estimate": r["estimate_ms"] / 1e3,
                    "wait": (r.get("wait_ms") or 0.0) / 1e3,
                    "runner_up": (r.get("runner_up_ms") or float("nan")) / 1e3,
                    "spilled": r.get("spilled"),
                    "queue": None,
                })
            elif "ttft_s" in r:
                kind = "decisions"
                if policy and r["policy"] != policy:
                    continue
                if r.get("ttft_s") is None or r.get("estimate_s") is None:
                    continue
                out.append({
                    "at": "%.1f s" % r["arrival_s"],
                    "replica": r["replica"],
                    "reason": r.get("reason"),
                    "prompt": r["prompt_tokens"],
                    "matched": r.get("matched_tokens"),
                    "cached": r["cached_tokens"],
                    "ttft": r["ttft_s"],
                    "estimate": r["estimate_s"],
                    "wait": r.get("wait_s") or 0.0,
                    "runner_up": r.get("runner_up_s") or float("nan"),
                    "spilled": r.get("spilled"),
                    "queue": "%d run %d wait, %d idle" % (
                        r["running"], r["waiting"], r["idle_replicas"]),
                })
    return kind, out


def quantile(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--percent", type=float, default=1.0, help="the slowest share shown (1)")
    ap.add_argument("--policy", default="cache_aware", help="decisions: the policy (cache_aware)")
    a = ap.parse_args()
    kind, reqs = rows(a.file, a.policy)
    if not reqs:
        sys.exit("%s: no request with both a time to first byte and an estimate" % a.file)
    reqs.sort(key=lambda r: -r["ttft"])
    n = max(1, int(round(len(reqs) * a.percent / 100)))
    slow = reqs[:n]
    print("%s: %d requests (%s), the slowest %d (%.3g%%), seconds" % (
        a.file, len(reqs), kind, n, a.percent))
    print("%-24s %-22s %-6s %7s %7s %7s  %6s %6s %6s %6s %6s  %s" % (
        "arrived", "replica", "reason", "prompt", "matched", "cached", "ttft", "est",
        "wait", "runner", "x_est", "queue at arrival"))
    for r in slow:
        print("%-24s %-22s %-6s %7s %7s %7s  %6.3f %6.3f %6.3f %6.3f %6.2f  %s%s" % (
            r["at"], str(r["replica"])[-22:], r["reason"], r["prompt"], r["matched"],
            "-" if r["cached"] is None else r["cached"], r["ttft"], r["estimate"], r["wait"],
            r["runner_up"], r["ttft"] / r["estimate"] if r["estimate"] > 0 else float("nan"),
            r["queue"] or "-", " spilled" if r["spilled"] else ""))
    print()
    print("%-22s %8s %8s %10s %10s %8s" % (
        "replica", "requests", "slowest", "x_est_p50", "x_est_p90", "ttft_p90"))
    for rep in sorted({r["replica"] for r in reqs}, key=str):
        mine = [r for r in reqs if r["replica"] == rep]
        err = [r["ttft"] / r["estimate"] for r in mine if r["estimate"] > 0]
        print("%-22s %8d %8d %10.2f %10.2f %8.3f" % (
            str(rep)[-22:], len(mine), sum(1 for r in slow if r["replica"] == rep),
            quantile(err, 0.5), quantile(err, 0.9), quantile([r["ttft"] for r in mine], 0.9)))


if __name__ == "__main__":
    main()
