#!/usr/bin/env python3
"""Helpers of bench/instances.sh (standard library only).

    instances.py ready SECONDS ADMIN...
        waits until every kvlb instance (its admin address) is subscribed to every replica's KV
        events and has a fresh scrape of its /metrics; exits 1 after SECONDS
    instances.py sample OUT EVERY ADMINS REPLICAS
        until SIGTERM, every EVERY seconds reads at once (one thread each) every instance's
        /replicas and every replica's /metrics and appends the moment to OUT as one JSON line;
        ADMINS and REPLICAS are comma-separated host:port lists
    instances.py expected OUT ADMIN...
        kvlb's expected hit rate over the instances (their /metrics) as JSON in OUT
    instances.py probes ACCESS_LOG... --skip N...
        the probe requests' routing per instance, from their access logs
    instances.py report TMP ROUNDS INSTANCES
        the table: one instance against INSTANCES, balance, hit rate, TTFT, the ratios, the
        agreement of the instances' views (samples) and of their choices (probes)
"""

import json
import math
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request


def get(addr, path, timeout=5.0):
    with urllib.request.urlopen("http://%s%s" % (addr, path), timeout=timeout) as r:
        return r.read()


def replicas_view(admin):
    return json.loads(get(admin, "/replicas"))["replicas"]


def ready(limit, admins):
    deadline = time.time() + limit
    while time.time() < deadline:
        try:
            if all(
                r["telemetry"]["events_connected"] and r["telemetry"]["reported"]["fresh"]
                for a in admins
                for r in replicas_view(a)
            ):
                return 0
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return 1


def queue(text):
    """running + waiting from a replica's /metrics (vLLM names)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running") or line.startswith(
            "vllm:num_requests_waiting"
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sample(out, every, admins, replicas):
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(out, "a") as f:
        while not stop.is_set():
            t0 = time.time()
            views, truth = [None] * len(admins), [None] * len(replicas)

            def view(i):
                try:
                    views[i] = [
                        {
                            "url": r["url"],
                            "in_flight": r["in_flight"],
                            "resident": r["resident_blocks"],
                            "reported": r["reported_blocks"],
                            "foreign": r["telemetry"]["reported"]["foreign_running"]
                            + r["telemetry"]["reported"]["foreign_waiting"],
                            "fresh": r["telemetry"]["reported"]["fresh"],
                        }
                        for r in replicas_view(admins[i])
                    ]
                except (OSError, ValueError, KeyError):
                    pass

            def metrics(i):
                try:
                    truth[i] = queue(get(replicas[i], "/metrics").decode())
                except (OSError, ValueError):
                    pass

            threads = [threading.Thread(target=view, args=(i,)) for i in range(len(admins))]
            threads += [threading.Thread(target=metrics, args=(i,)) for i in range(len(replicas))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if all(v is not None for v in views) and all(q is not None for q in truth):
                f.write(json.dumps({"t": t0, "took_s": time.time() - t0, "views": views,
                                    "truth": truth}) + "\n")
                f.flush()
            stop.wait(max(0.0, every - (time.time() - t0)))
    return 0


def probes(args):
    """Per access log (one per instance), the probe lines: those after the first N."""
    skip = [int(s) for s in args[args.index("--skip") + 1:]]
    logs = args[: args.index("--skip")]
    out = []
    for path, n in zip(logs, skip):
        rows = []
        with open(path) as f:
            for i, line in enumerate(f):
                if i < n:
                    continue
                row = json.loads(line)
                if row.get("path") == "/v1/completions":
                    rows.append(row)
        out.append(rows)
    print(json.dumps(out))
    return 0


def expected(out, admins):
    """kvlb's own expected hit rate, summed over the instances: the prompt tokens it counted
    as resident on the replica it chose over the prompt tokens it routed."""
    matched = prompt = 0.0
    for a in admins:
        for line in get(a, "/metrics").decode().splitlines():
            if line.startswith("kvlb_model_matched_tokens_total"):
                matched += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvlb_model_prompt_tokens_total"):
                prompt += float(line.rsplit(" ", 1)[1])
    with open(out, "w") as f:
        json.dump({"expected_hit": matched / prompt if prompt else None}, f)
    return 0


def pct(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(math.ceil(p / 100.0 * len(values))) - 1)]


def cv(values):
    m = statistics.mean(values)
    return statistics.pstdev(values) / m if m else float("nan")


def load_json(path):
    return json.load(open(path)) if os.path.exists(path) else None


def report(tmp, rounds, instances):
    rows = []
    for r in range(1, rounds + 1):
        for mode in ("one", "many"):
            s = load_json(os.path.join(tmp, "%s.r%d.json" % (mode, r)))
            if s is None:
                continue
            reqs = [x["requests"] for x in s["replicas"]]
            comp = [x["computed_tokens"] for x in s["replicas"]]
            exp = load_json(os.path.join(tmp, "%s.r%d.expected.json" % (mode, r))) or {}
            rows.append({
                "round": r, "mode": mode, "n": 1 if mode == "one" else instances,
                "requests": s["requests"], "errors": s["errors"],
                "max_mean_req": max(reqs) / statistics.mean(reqs),
                "cv_req": cv(reqs),
                "max_mean_comp": max(comp) / statistics.mean(comp),
                "cv_comp": cv(comp),
                "idle_replicas": sum(1 for x in reqs if x == 0),
                "hit_rate": s["hit_rate"],
                "expected_hit": exp.get("expected_hit"),
                "ttft_p50": s["ttft_p50_s"], "ttft_p99": s["ttft_p99_s"],
                "ttft_p90": s.get("ttft_p90_s"),
                "spread": exp.get("spread"),
            })
    print("%-5s %-6s %5s %6s %4s  %8s %6s %9s %7s %5s  %7s %7s  %8s %8s %8s" % (
        "round", "kvlb", "n", "reqs", "err", "max/mean", "cv", "max/mean", "cv", "idle",
        "hit", "kvlb_hit", "ttft_p50", "ttft_p90", "ttft_p99"))
    print("%-5s %-6s %5s %6s %4s  %15s %17s %5s" % ("", "", "", "", "", "(requests)",
                                                   "(computed tokens)", ""))
    fmt = lambda v, f: "-" if v is None else f % v
    for x in rows:
        print("%-5d %-6s %5d %6d %4d  %8.3f %6.3f %9.3f %7.3f %5d  %7s %8s  %8s %8s %8s" % (
            x["round"], x["mode"], x["n"], x["requests"], x["errors"], x["max_mean_req"],
            x["cv_req"], x["max_mean_comp"], x["cv_comp"], x["idle_replicas"],
            fmt(x["hit_rate"] and 100 * x["hit_rate"], "%.2f%%"),
            fmt(x["expected_hit"] and 100 * x["expected_hit"], "%.2f%%"),
            fmt(x["ttft_p50"], "%.3f"), fmt(x["ttft_p90"], "%.3f"), fmt(x["ttft_p99"], "%.3f")))
    print()
    print("%d instances over one, same round (1.000 = the same; target: balance and hit rate "
          "within 5%%)" % instances)
    print("%-5s %12s %12s %10s %10s %10s %10s" % (
        "round", "max/mean_req", "max/mean_cmp", "cv_req", "hit_rate", "ttft_p50", "ttft_p99"))
    verdicts = []
    for r in range(1, rounds + 1):
        one = [x for x in rows if x["round"] == r and x["mode"] == "one"]
        many = [x for x in rows if x["round"] == r and x["mode"] == "many"]
        if not one or not many:
            continue
        o, e = one[0], many[0]
        ratio = lambda k: e[k] / o[k] if o[k] else float("nan")
        print("%-5d %12.3f %12.3f %10.3f %10.3f %10.3f %10.3f" % (
            r, ratio("max_mean_req"), ratio("max_mean_comp"), ratio("cv_req"),
            ratio("hit_rate"), ratio("ttft_p50"), ratio("ttft_p99")))
        for key, name in (("max_mean_req", "balance (max/mean requests)"),
                          ("max_mean_comp", "balance (max/mean computed tokens)"),
                          ("hit_rate", "hit rate")):
            q = ratio(key)
            verdicts.append("round %d: %s %d/1 %.3f: %s" % (
                r, name, instances, q, "within 5%" if abs(q - 1) <= 0.05 else "NOT within 5%"))
    print()
    for v in verdicts:
        print(v)

    # Agreement of the views, sampled during each run of several instances.
    for r in range(1, rounds + 1):
        path = os.path.join(tmp, "many.r%d.samples.jsonl" % r)
        if not os.path.exists(path):
            continue
        moments = [json.loads(line) for line in open(path)]
        rep_spread, res_spread, load_err, load_spread, truth_all, took = [], [], [], [], [], []
        equal = total = 0
        for m in moments:
            views, truth = m["views"], m["truth"]
            took.append(m["took_s"])
            for j in range(len(truth)):
                rep = [v[j]["reported"] for v in views]
                res = [v[j]["resident"] for v in views]
                seen = [v[j]["in_flight"] + v[j]["foreign"] for v in views]
                total += 1
                equal += max(rep) == min(rep)
                if max(rep):
                    rep_spread.append((max(rep) - min(rep)) / max(rep))
                if max(res):
                    res_spread.append((max(res) - min(res)) / max(res))
                load_spread.append(max(seen) - min(seen))
                load_err.extend(abs(s - truth[j]) for s in seen)
                truth_all.append(truth[j])
        print()
        print("round %d, agreement of the %d instances' views during the run: %d moments "
              "(each read in %.2f s at most), %d replicas each" % (
                  r, instances, len(moments), max(took or [0]), len(moments[0]["truth"])
                  if moments else 0))
        print("  reported blocks (KV events) per replica: identical in all instances in "
              "%.1f%% of (moment, replica); spread (max-min)/max median %.3f, p99 %.3f" % (
                  100.0 * equal / max(total, 1), pct(rep_spread, 50), pct(rep_spread, 99)))
        print("  resident blocks (events and each instance's own routing guesses): spread "
              "median %.3f, p99 %.3f" % (pct(res_spread, 50), pct(res_spread, 99)))
        print("  load seen (own in flight + foreign from the last scrape) vs the replica's own "
              "running+waiting (mean %.2f): |seen - replica| mean %.2f, p99 %.0f; spread "
              "across instances (max-min) mean %.2f, p99 %.0f requests" % (
                  statistics.mean(truth_all) if truth_all else 0,
                  statistics.mean(load_err) if load_err else 0, pct(load_err, 99),
                  statistics.mean(load_spread) if load_spread else 0, pct(load_spread, 99)))

    # Agreement of the choices: the same prompts sent through each instance in turn.
    for r in range(1, rounds + 1):
        p = load_json(os.path.join(tmp, "many.r%d.probes.json" % r))
        if not p:
            continue
        # A replay's lines are in the order its requests finished: a probe is known by its
        # prompt tokens (and its rank among probes of that length).
        def keyed(rows):
            seen, out = {}, {}
            for row in rows:
                k = (row["prompt_tokens"], seen.get(row["prompt_tokens"], 0))
                seen[row["prompt_tokens"]] = k[1] + 1
                out[k] = row
            return out

        per = [keyed(x) for x in p]
        keys = sorted(set.intersection(*[set(k) for k in per]))
        if not keys:
            continue
        same = 0
        followed = []
        first_match = later_match = 0.0
        for k in keys:
            reps = [x[k]["replica"] for x in per]
            same += len(set(reps)) == 1
            followed.extend(1 if rr == reps[0] else 0 for rr in reps[1:])
            first_match += per[0][k]["matched_tokens"] / max(per[0][k]["prompt_tokens"], 1)
            later_match += statistics.mean(
                x[k]["matched_tokens"] / max(x[k]["prompt_tokens"], 1) for x in per[1:])
        n = len(keys)
        print()
        print("round %d, the same %d prompts (from just after the slice) sent through each of "
              "the %d instances in turn, fleet otherwise idle:" % (r, n, len(p)))
        print("  all instances chose the same replica for %d of %d (%.1f%%); instances 2..%d "
              "chose the first instance's replica in %.1f%% of %d choices" % (
                  same, n, 100.0 * same / n, len(p),
                  100.0 * sum(followed) / max(len(followed), 1), len(followed)))
        print("  matched tokens over prompt tokens: %.1f%% for the first instance, %.1f%% for "
              "the others (the first one's blocks reached them as KV events)" % (
                  100.0 * first_match / n, 100.0 * later_match / n))
    return 0


def main():
    cmd = sys.argv[1]
    if cmd == "ready":
        return ready(float(sys.argv[2]), sys.argv[3:])
    if cmd == "sample":
        return sample(sys.argv[2], float(sys.argv[3]), sys.argv[4].split(","),
                      sys.argv[5].split(","))
    if cmd == "expected":
        return expected(sys.argv[2], sys.argv[3:])
    if cmd == "probes":
        return probes(sys.argv[2:])
    if cmd == "report":
        return report(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
