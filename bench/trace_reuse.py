#!/usr/bin/env python3
"""Prefix reuse in a Mooncake trace: what hit rate any router could reach.

For a Mooncake JSONL trace (512-token blocks, `hash_ids` naming each block and its whole
prefix) this prints:

* the hit-rate upper bound with an unbounded cache (a block counts as a hit when any earlier
  request carried its id: the leading-prefix rule holds by construction of the ids);
* the hit rate of one LRU cache of N tokens, for the pooled fleet capacity (replicas x
  per-replica KV) and for one replica alone: a router that sent every request to the one
  replica holding its prefix, with no load limit, can at best reach the pooled figure;
* the reuse-distance distribution: for every reused block, the distinct tokens touched
  between its previous use and this one (LRU stack distance). An LRU cache of C tokens hits
  exactly the reuses with distance < C, so the distribution says whether capacity or
  placement limits the hit rate;
* where the reuse is: the shared first block versus a conversation's own history.

Usage: python3 bench/trace_reuse.py TRACE.jsonl [--replicas 4] [--kv-tokens 400000]
Pure standard library; about 10 s on the conversation trace.
"""
import argparse
import json
from collections import OrderedDict

BLOCK = 512


def load(path):
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                reqs.append((r["timestamp"], r["input_length"], r["hash_ids"]))
    reqs.sort(key=lambda r: r[0])
    return reqs


def block_tokens(prompt, j):
    return max(0, min(BLOCK, prompt - j * BLOCK))


def leading_held(ids, held):
    """How many of the leading block ids are in held (a prefix match stops at the first miss)."""
    matched = 0
    for id_ in ids:
        if id_ not in held:
            break
        matched += 1
    return matched


def lru_hits(reqs, capacity_tokens):
    """Prefix hits of one LRU cache of capacity_tokens (whole 512-token blocks)."""
    cap = max(1, capacity_tokens // BLOCK)
    cache = OrderedDict()
    hits = 0
    for _, prompt, ids in reqs:
        matched = leading_held(ids, cache)
        hits += min(prompt, matched * BLOCK)
        # Touch last to first so the prefix is the most recent, as the engine frees tails first.
        for id_ in reversed(ids):
            cache[id_] = True
            cache.move_to_end(id_)
        while len(cache) > cap:
            cache.popitem(last=False)
    return hits


class Fenwick:
    def __init__(self, n):
        self.n = n
        self.t = [0] * (n + 1)

    def add(self, i, v):
        i += 1
        while i <= self.n:
            self.t[i] += v
            i += i & -i

    def prefix(self, i):
        """Sum of positions [0, i)."""
        s = 0
        while i > 0:
            s += self.t[i]
            i -= i & -i
        return s


def reuse_distances(reqs):
    """For each block reuse: (tokens reused, distinct blocks touched since its last use)."""
    accesses = []
    for _, prompt, ids in reqs:
        # Same order as lru_hits: last to first.
        for j in reversed(range(len(ids))):
            accesses.append(ids[j])
    fw = Fenwick(len(accesses))
    last = {}
    out = {}
    for pos, id_ in enumerate(accesses):
        if id_ in last:
            p = last[id_]
            distinct = fw.prefix(pos) - fw.prefix(p + 1)
            out.setdefault(id_, []).append(distinct)
            fw.add(p, -1)
        fw.add(pos, 1)
        last[id_] = pos
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=400_000)
    a = ap.parse_args()
    reqs = load(a.trace)
    total = sum(p for _, p, _ in reqs)
    seen = set()
    unbounded = 0
    first_block_hits = 0
    for _, prompt, ids in reqs:
        matched = leading_held(ids, seen)
        unbounded += min(prompt, matched * BLOCK)
        if matched >= 1:
            first_block_hits += block_tokens(prompt, 0)
        seen.update(ids)
    span_s = (reqs[-1][0] - reqs[0][0]) / 1000
    print(f"{a.trace}: {len(reqs)} requests, {total} prompt tokens, span {span_s:.0f} s,"
          f" {len(seen)} distinct blocks ({len(seen) * BLOCK / 1e6:.1f} M tokens)")
    print(f"hit-rate upper bound, unbounded cache:   {unbounded / total:.4f}"
          f"  (shared first block alone: {first_block_hits / total:.4f})")
    for label, cap in [
        (f"pooled {a.replicas} x {a.kv_tokens}", a.replicas * a.kv_tokens),
        (f"one replica {a.kv_tokens}", a.kv_tokens),
        ("8 x pooled (offload tier)", 8 * a.replicas * a.kv_tokens),
    ]:
        print(f"LRU hit rate, {label:>26} tokens: {lru_hits(reqs, cap) / total:.4f}")
    dists = reuse_distances(reqs)
    # Weight each reuse by its block's tokens (full blocks: the last partial ones rarely recur).
    flat = sorted(d for ds in dists.values() for d in ds if True)
    nonzero = [d for id_, ds in dists.items() if id_ != 0 for d in ds]
    nonzero.sort()
    print(f"block reuses: {len(flat)} (of which block 0: {len(dists.get(0, []))})")
    if nonzero:
        qs = [0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
        line = ", ".join(
            f"p{int(q * 100)} {nonzero[min(len(nonzero) - 1, int(q * len(nonzero)))] * BLOCK / 1e6:.2f} M"
            for q in qs)
        print(f"reuse distance (tokens, blocks other than 0): {line}")
        for cap in [a.kv_tokens, a.replicas * a.kv_tokens, 4 * a.replicas * a.kv_tokens,
                    8 * a.replicas * a.kv_tokens]:
            share = sum(1 for d in nonzero if d * BLOCK < cap) / len(nonzero)
            print(f"  reuses within {cap / 1e6:5.1f} M tokens: {share:.3f}")


if __name__ == "__main__":
    main()
