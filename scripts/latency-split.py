#!/usr/bin/env python3
"""Splits a one-in-flight RDMA round trip into its parts, from the timestamps that a build
with transport-rdma's `latency-probe` feature writes (see transport-rdma/src/probe.rs).

usage: latency-split.py DIR

DIR holds the records of exactly two processes of one run, a client and a server
(probe-<pid>-post.txt and probe-<pid>-recv.txt each). The client is the process that posted
first. For each of the client's posts after the first quarter (warm-up), it finds the server's
next receive completion, the server's next post after it, the client's next receive completion
after that and the client's next post, and prints the median of each part in microseconds:

  request on the wire   client post -> server completion found (the sender's post, the
                        device's work, the peer's detection)
  server                server completion found -> its answer posted
  answer on the wire    server post -> client completion found
  client                client completion found -> its next request posted
"""
import bisect
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
        m = re.match(r"probe-(\d+)-(post|recv)\.txt$", os.path.basename(path))
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
    parts = [[], [], [], []]
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
        for part, (a, b) in zip(parts, [(pc[i], rs[j]), (rs[j], ps[k]), (ps[k], rc[m]),
                                        (rc[m], pc[i + 1])]):
            part.append(b - a)
    if not parts[0]:
        sys.exit(f"{d}: no complete round trips found")
    med = [statistics.median(p) / 1000 for p in parts]
    total = statistics.median(sum(x) for x in zip(*parts)) / 1000
    print(f"{len(parts[0])} round trips (client pid {client}, server pid {server}), medians in us:")
    print(f"  request on the wire {med[0]:7.1f}")
    print(f"  server              {med[1]:7.1f}")
    print(f"  answer on the wire  {med[2]:7.1f}")
    print(f"  client              {med[3]:7.1f}")
    print(f"  round trip          {total:7.1f}")


if __name__ == "__main__":
    main()
