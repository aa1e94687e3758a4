#!/usr/bin/env python3
"""Issue 3's performance targets, worked out from one `scripts/rdma-test.sh` run.

Usage: scripts/rdma-targets.py SUMMARY

SUMMARY is the guest's summary.txt (rdma-test.sh passes its own). For each device this prints
each ratio beside its target, from the figures of that run alone:
- busy-poll small-call p50 against perftest's `ib_send_lat` typical one-way figure (at most 3x),
  once for the main figures and once per paired round (perftest, then rdma-rpc, back to back),
  with the rounds' median;
  the verdict is the paired rounds' median: the main figures are minutes apart, and perftest's
  own figure moves by up to 2x within one boot. A round whose `ib_send_lat` figure is not
  typical is left out of the verdict (and says so): one against which the connection layer's
  floor of the same round (below) came out under 2x, i.e. quicker than perftest's own round
  trip, which no RPC on this transport can be;
- for information, the connection layer's floor (`verbs-pingpong --lean --borrow`: SEND/RECV
  loops that never wait and receive borrowed from the slot, no RPC layer) against the same
  `ib_send_lat`, in the main figures and per paired round: what this transport's own code
  takes per round trip, under any RPC layer;
- the default mode's p50 against busy-poll's (at most 2x);
- 1 MiB and 16 MiB put bandwidth against `ib_read_bw` at 64 KiB (the device's best figure)
  and at the same size (at least 80%), and in each paired round against the `ib_read_bw` at
  64 KiB run just before it, with the rounds' median, which is the verdict.

A figure that is missing (its run failed, or perftest printed zero) is reported as missing, and
a paired round without its perftest figure is left out. The verdicts are information,
not test results: the exit status is 0 unless SUMMARY cannot be read.
"""

import re
import statistics
import sys

SEND_LAT = re.compile(r"^perftest (\S+) ib_send_lat 2 B: typical ([0-9.]+) us")
READ_BW = re.compile(
    r"^perftest (\S+) ib_read_bw (\d+) B x \d+, (\d+) READs outstanding: average ([0-9.]+) MiB/s"
)
FAILED_PERF = re.compile(r"^perftest (\S+) (ib_send_lat|ib_read_bw) .*: FAILED")
# rpc-perf's label of a put size, its bytes, its name here
PUT_SIZES = (("1M", 1 << 20, "1 MiB"), ("16M", 16 << 20, "16 MiB"))
RPC = re.compile(r"^rpc-perf (\S+) (\S+) (\S+) B: p50 ([0-9.]+) us.*\(([0-9.]+) MiB/s\)")
FLOOR = re.compile(r"^verbs-pingpong (\S+) (lean\S*) 32 B SEND/RECV round trip .*: p50 ([0-9.]+) us")


def verdict(ok):
    return "met" if ok else "missed"


def main(path):
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        print(f"rdma-targets: {e}", file=sys.stderr)
        return 1
    send_lat = {}  # dev -> the main run's typical one-way, us
    paired = {}  # dev -> [(round, ib_send_lat, rdma-rpc p50)]
    floor = {}  # dev -> the main run's lean ping-pong p50, us
    paired_floor = {}  # dev -> [(round, ib_send_lat, lean ping-pong p50)]
    read_bw = {}  # (dev, bytes) -> MiB/s, with more than one READ outstanding
    p50 = {}  # (dev, label) -> us
    mibs = {}  # (dev, label, size) -> MiB/s
    last_lat = {}  # dev -> the latest ib_send_lat figure, for the paired round that follows
    last_bw = {}  # dev -> the latest ib_read_bw figure at 64 KiB, likewise
    paired_bw = {}  # (dev, size) -> [(ib_read_bw 64 KiB, rdma-rpc MiB/s)]
    for line in lines:
        m = SEND_LAT.match(line)
        if m:
            dev, t = m.group(1), float(m.group(2))
            if t <= 0:
                # perftest printed a row of zeros (seen on siw: exit 0, "0.00"): no figure
                last_lat.pop(dev, None)
                continue
            send_lat.setdefault(dev, t)
            last_lat[dev] = t
            continue
        m = READ_BW.match(line)
        if m:
            dev, nbytes, mib = m.group(1), int(m.group(2)), float(m.group(4))
            if mib <= 0:
                # likewise: no figure to compare with, nor to pair with what follows
                if nbytes == 65536:
                    last_bw.pop(dev, None)
                continue
            if int(m.group(3)) > 1:
                read_bw.setdefault((dev, nbytes), mib)
                if nbytes == 65536:
                    last_bw[dev] = mib
            continue
        m = FAILED_PERF.match(line)
        if m:
            # a perftest run that failed: no figure to pair with what follows
            (last_lat if m.group(2) == "ib_send_lat" else last_bw).pop(m.group(1), None)
            continue
        m = FLOOR.match(line)
        if m:
            dev, label, us = m.group(1), m.group(2), float(m.group(3))
            if label == "lean":
                floor.setdefault(dev, us)
            elif dev in last_lat:
                rnd = label.rsplit("-", 1)[-1]
                paired_floor.setdefault(dev, []).append((rnd, last_lat[dev], us))
            continue
        m = RPC.match(line)
        if m:
            dev, label, size = m.group(1), m.group(2), m.group(3)
            us, mib = float(m.group(4)), float(m.group(5))
            if label.startswith("small-call-busy-poll-paired"):
                if dev in last_lat:
                    rnd = label.rsplit("-", 1)[-1]
                    paired.setdefault(dev, []).append((rnd, last_lat[dev], us))
                continue
            if label.startswith("bandwidth-paired"):
                if dev in last_bw:
                    paired_bw.setdefault((dev, size), []).append((last_bw[dev], mib))
                continue
            p50.setdefault((dev, label), us)
            mibs.setdefault((dev, label, size), mib)
    devs = sorted({d for d, _ in p50} | set(send_lat))
    if not devs:
        print("issue 3 targets: no figures in this run")
        return 0
    for dev in devs:
        print(f"issue 3 targets on {dev}, from this run's figures:")
        busy = p50.get((dev, "small-call-busy-poll"))
        lat = send_lat.get(dev)
        if busy is not None and lat:
            r = busy / lat
            print(
                f"  busy-poll p50 {busy:.1f} us = {r:.2f}x ib_send_lat {lat:.2f} us "
                f"(target <= 3x; taken minutes apart, so the paired rounds decide)"
            )
        else:
            print("  busy-poll p50 against ib_send_lat: a figure is missing")
        rounds = paired.get(dev, [])
        if rounds:
            # rounds whose ib_send_lat the same round's floor beat perftest's own round trip
            floor_of = {r: b / t for r, t, b in paired_floor.get(dev, [])}
            odd = {r for r, _, _ in rounds if floor_of.get(r, 2.0) < 2.0}
            each = ", ".join(
                f"{b:.1f}/{t:.2f} = {b / t:.2f}x" + (" (left out)" if r in odd else "")
                for r, t, b in rounds
            )
            kept = [b / t for r, t, b in rounds if r not in odd]
            if kept:
                med = statistics.median(kept)
                print(
                    f"  paired rounds (ib_send_lat, then the busy-poll call): {each}; "
                    f"median {med:.2f}x: {verdict(med <= 3)}"
                )
            else:
                print(
                    f"  paired rounds (ib_send_lat, then the busy-poll call): {each}; "
                    "undecided: no round's ib_send_lat figure was typical"
                )
            if odd:
                print(
                    "  (left out: rounds whose ib_send_lat figure was not typical, the same "
                    "round's connection-layer floor coming out under 2x it, quicker than "
                    "perftest's own round trip)"
                )
        lean = floor.get(dev)
        if lean is not None and lat:
            print(
                "  connection-layer floor (verbs-pingpong --lean --borrow, no RPC layer) "
                f"p50 {lean:.1f} us = {lean / lat:.2f}x ib_send_lat (information)"
            )
        rounds = paired_floor.get(dev, [])
        if rounds:
            each = ", ".join(f"{b:.1f}/{t:.2f} = {b / t:.2f}x" for _, t, b in rounds)
            med = statistics.median(b / t for _, t, b in rounds)
            print(
                f"  paired rounds, the connection-layer floor against the same ib_send_lat: "
                f"{each}; median {med:.2f}x (information: under any RPC layer on this transport)"
            )
        default = p50.get((dev, "small-call-default"))
        if default is not None and busy:
            r = default / busy
            print(
                f"  default p50 {default:.1f} us = {r:.2f}x busy-poll (target <= 2x): "
                f"{verdict(r <= 2)}"
            )
        else:
            print("  default mode against busy-poll: a figure is missing")
        best = read_bw.get((dev, 65536))
        for size, nbytes, name in PUT_SIZES:
            put = mibs.get((dev, "bandwidth", size))
            same = read_bw.get((dev, nbytes))
            if put is None or not best:
                print(f"  put {name} against ib_read_bw: a figure is missing")
                continue
            at_same = f", {100 * put / same:.1f}% of ib_read_bw at {name} ({same:.1f})" if same else ""
            print(
                f"  put {name} {put:.1f} MiB/s = {100 * put / best:.1f}% of ib_read_bw 64 KiB "
                f"({best:.1f}){at_same} (target >= 80% of the 64 KiB figure; taken minutes "
                f"apart, so the paired rounds decide)"
            )
        for size, _, name in PUT_SIZES:
            rounds = paired_bw.get((dev, size), [])
            if not rounds:
                continue
            shares = [100 * p / b for b, p in rounds]
            each = ", ".join(f"{p:.1f}/{b:.1f} = {100 * p / b:.1f}%" for b, p in rounds)
            med = statistics.median(shares)
            print(
                f"  paired rounds, put {name} against ib_read_bw 64 KiB: {each}; "
                f"median {med:.1f}%: {verdict(med >= 80)}"
            )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
