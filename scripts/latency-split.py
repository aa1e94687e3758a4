#!/usr/bin/env python3
"""Splits a one-in-flight RDMA round trip into its parts, from the timestamps that a build
with transport-rdma's `latency-probe` feature writes (see transport-rdma/src/probe.rs).

usage: latency-split.py DIR

DIR holds the records of exactly two processes of one run, a client and a server
(probe-<pid>-post.txt and probe-<pid>-recv.txt each, and probe-<pid>-posted.txt from builds
that record when a post returned). The client is the process that posted first. For each of
the client's posts after the first quarter (warm-up), it finds the server's next receive
completion, the server's next post after it, the client's next receive completion after that
and the client's next post, and prints the median and the 99th percentile of each part in
microseconds:

  request on the wire   client post -> server completion found (the sender's post, the
                        device's work, the peer's detection)
    the post call       client post -> its post call returned (with posted records; on rxe
                        the device's whole work, the peer's receive included, runs in it)
  server                server completion found -> its answer posted
  answer on the wire    server post -> client completion found
    the post call       server post -> its post call returned
  client                client completion found -> its next request posted

and then which part grew most in the slowest 1% of round trips (the tail).
"""
import bisect
import collections
import glob
import os
import re
import statistics
import sys


def load(path):
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    recs = {}
    for path in glob.glob(os.path.join(d, "probe-*-*.txt")):
        m = re.match(r"probe-(\d+)-(post|posted|recv)\.txt$", os.path.basename(path))
        if m:
            recs.setdefault(m.group(1), {})[m.group(2)] = load(path)
    full = {p: r for p, r in recs.items() if "post" in r and "recv" in r}
    if len(full) != 2:
        sys.exit(f"{d}: need the post and recv records of exactly two processes, "
                 f"found {sorted((p, sorted(r)) for p, r in recs.items())}")
    client = min(full, key=lambda p: full[p]["post"][0])
    server = next(p for p in full if p != client)
    pc, rc = full[client]["post"], full[client]["recv"]
    ps, rs = full[server]["post"], full[server]["recv"]
    # when each post call returned: the first such mark at or after the post's own
    dc, ds = full[client].get("posted"), full[server].get("posted")
    posted = dc is not None and ds is not None

    def returned(marks, t):
        i = bisect.bisect_left(marks, t)
        return marks[i] if i < len(marks) else None

    names = ["request on the wire", "  the client's post call", "server",
             "answer on the wire", "  the server's post call", "client"]
    rows = []
    for i in range(len(pc) // 4, len(pc) - 1):
        j = bisect.bisect_left(rs, pc[i])
        if j >= len(rs):
            break
        k = bisect.bisect_left(ps, rs[j])
        if k >= len(ps):
            break
        m = bisect.bisect_left(rc, ps[k])
        if m >= len(rc):
            break
        if pc[i + 1] < rc[m]:
            continue  # not a lone call: another post came before the answer
        pcall = qcall = None
        if posted:
            a, b = returned(dc, pc[i]), returned(ds, ps[k])
            if a is None or b is None:
                break
            pcall, qcall = a - pc[i], b - ps[k]
        rows.append((rs[j] - pc[i], pcall, ps[k] - rs[j], rc[m] - ps[k], qcall,
                     pc[i + 1] - rc[m]))
    if not rows:
        sys.exit(f"{d}: no complete round trips found")
    shown = [i for i in range(6) if posted or i not in (1, 4)]
    whole = [0, 2, 3, 5]  # the parts that add up to the round trip
    totals = sorted(sum(r[i] for i in whole) for r in rows)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000

    print(f"{len(rows)} round trips (client pid {client}, server pid {server}), in us:"
          f" median, 99th percentile")
    for i in shown:
        xs = sorted(r[i] for r in rows)
        print(f"  {names[i]:24s} {statistics.median(xs) / 1000:7.1f} {pct(xs, 0.99):7.1f}")
    print(f"  {'round trip':24s} {statistics.median(totals) / 1000:7.1f} {pct(totals, 0.99):7.1f}")
    # the tail: in the slowest 1%, the median of each part, and which part was furthest
    # above its own median most often
    cut = totals[min(len(totals) - 1, int(0.99 * len(totals)))]
    slow = [r for r in rows if sum(r[i] for i in whole) >= cut]
    med = {i: statistics.median(r[i] for r in rows) for i in whole}
    most = collections.Counter(max(whole, key=lambda i: r[i] - med[i]) for r in slow)
    print(f"  the slowest 1% ({len(slow)} round trips), median of each part: "
          + ", ".join(f"{names[i].strip()} {statistics.median(r[i] for r in slow) / 1000:.1f}"
                      for i in shown))
    print("  the part furthest above its median there: "
          + ", ".join(f"{names[i]} {most[i]}" for i in whole))

if __name__ == "__main__":
    main()
