#!/usr/bin/env python3
"""The code a process runs on every call: distinct instructions per call, from two callgrind runs.

    callgrind-footprint.py SHORT.out LONG.out CALLS [TOP] [--lines BINARY [ROOT]]

SHORT.out and LONG.out are callgrind outputs (`--dump-instr=yes --compress-pos=no
--compress-strings=no`) of the same program doing the same work, LONG with CALLS more calls than
SHORT. An instruction whose count grew by at least CALLS / 2 between the two runs runs (about)
once per call or more: it is part of the per-call footprint. Set-up and tear-down code runs as
often in both runs and drops out.

Prints the footprint (distinct instructions), the instructions executed per call, the footprint
per object file, and the TOP (default 25) functions with the largest share of it.

With `--lines BINARY`, also the TOP source lines of BINARY (a build with line tables, e.g.
`CARGO_PROFILE_RELEASE_DEBUG=line-tables-only`; the code is the same) that hold the most of it:
each per-call instruction of BINARY is mapped with `addr2line -i` to the innermost line of its
inline chain under ROOT (default: the current directory), or to its innermost line if none is.

Why it matters (docs/latency.md, "Code between two posts"): under QEMU's TCG the kernel's
work in `ibv_post_send` runs slower the more distinct user-space code ran since the last post,
so this count, which does not depend on load, predicts latency in the test bed better than a
timing does.
"""
import collections
import subprocess
import sys


def load(path):
    """Of one callgrind output: (object, function, address) -> self cost (Ir), and
    (caller, callee) -> how many calls."""
    cost = collections.defaultdict(int)
    calls = collections.Counter()
    ob = fn = cfn = None
    skip = False
    with open(path) as f:
        for line in f:
            if skip:  # the cost line after `calls=` is the call's inclusive cost
                skip = False
                continue
            if line.startswith("ob="):
                ob = line[3:].strip()
            elif line.startswith("fn="):
                fn = line[3:].strip()
            elif line.startswith("cfn="):
                cfn = line[4:].strip()
            elif line.startswith("calls="):
                calls[(fn, cfn)] += int(line.split()[0][6:])
                skip = True
            elif line.startswith("0x"):
                p = line.split()
                cost[(ob, fn, int(p[0], 16))] += int(p[-1])
    return cost, calls


def lines(per, every, binary, root, top):
    """Prints the TOP source lines of `binary` with the most per-call instructions."""
    name = binary.rsplit("/", 1)[-1]
    mine = lambda ob: (ob or "").rsplit("/", 1)[-1] == name
    # where the binary was loaded: callgrind's address of each function's first instruction
    # against the symbol table's
    syms = {}
    for line in subprocess.run(["nm", "--defined-only", binary], capture_output=True,
                               text=True, check=True).stdout.splitlines():
        p = line.split()
        if len(p) == 3:
            syms.setdefault(p[2], int(p[0], 16))
    first = {}
    for (ob, fn, a) in every:
        if mine(ob) and fn in syms:
            first[fn] = min(first.get(fn, a), a)
    deltas = collections.Counter(a - syms[fn] for fn, a in first.items())
    if not deltas:
        sys.exit(f"callgrind-footprint: no function of {binary} found in the outputs")
    delta = deltas.most_common(1)[0][0]
    addrs = sorted({a for (ob, _, a) in per if mine(ob)})
    out = subprocess.run(["addr2line", "-a", "-i", "-e", binary],
                         input="\n".join(f"{a - delta:#x}" for a in addrs),
                         capture_output=True, text=True, check=True).stdout.splitlines()
    chains, cur = [], None
    for line in out:
        if line.startswith("0x"):
            cur = []
            chains.append(cur)
        elif cur is not None:
            cur.append(line)
    by_line = collections.Counter()
    for chain in chains:
        inside = [l for l in chain if l.startswith(root)]
        at = (inside or chain or ["??:0"])[0]
        by_line[at.split(" (discriminator")[0].replace(root, "", 1)] += 1
    print(f"  {len(addrs)} of them in {name}; the {top} source lines with the most:")
    for at, n in by_line.most_common(top):
        print(f"  {n:5d}  {at}")


def demangle(names):
    """`names` demangled (as they are if c++filt is missing)."""
    try:
        return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                              text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return list(names)


def print_calls(short, long_, calls, top):
    """Prints the function calls made per call, and the TOP callees with their main caller.

    Under TCG a call and its return cost about as much as ~25 instructions (each return, and
    each indirect call, looks up its target's translated block): docs/latency.md, "Fewer
    calls on the small call's path"."""
    per_callee = collections.Counter()
    caller = {}
    for k, c in long_.items():
        d = (c - short.get(k, 0)) / calls
        if d >= 0.5:
            per_callee[k[1]] += d
            if d > caller.get(k[1], (0, None))[0]:
                caller[k[1]] = (d, k[0])
    rows = per_callee.most_common(top)
    names = demangle([c or "?" for c, _ in rows] + [caller[c][1] or "?" for c, _ in rows])
    print(f"  {sum(per_callee.values()):.0f} function calls per call; the {len(rows)} callees "
          "called most (calls per call, callee, its main caller):")
    for i, (_, n) in enumerate(rows):
        print(f"  {n:6.2f}  {names[i][:90]}  <- {names[len(rows) + i][:60]}")


def main():
    args = sys.argv[1:]
    binary = root = None
    if "--lines" in args:
        i = args.index("--lines")
        binary = args[i + 1]
        rest = args[i + 2:]
        root = rest[0] if rest else None
        args = args[:i]
    if len(args) < 3:
        sys.exit(__doc__)
    (short, short_calls), (long_, long_calls) = load(args[0]), load(args[1])
    calls = int(args[2])
    top = int(args[3]) if len(args) > 3 else 25
    if calls <= 0:
        sys.exit("callgrind-footprint: CALLS must be positive")
    per = {}
    for k, c in long_.items():
        d = c - short.get(k, 0)
        if d >= calls / 2:
            per[k] = d
    print(f"footprint: {len(per)} distinct instructions per call; "
          f"{sum(per.values()) / calls:.0f} instructions executed per call")
    by_ob = collections.Counter()
    by_fn = collections.Counter()
    ir_fn = collections.Counter()
    for (ob, fn, _), c in per.items():
        o = (ob or "?").rsplit("/", 1)[-1]
        by_ob[o] += 1
        by_fn[(o, fn)] += 1
        ir_fn[(o, fn)] += c
    for o, n in by_ob.most_common():
        print(f"  {n:6d}  {o}")
    rows = by_fn.most_common(top)
    demangled = demangle([fn or "?" for (_, fn), _ in rows])
    print(f"  {len(by_fn)} functions; the {len(rows)} with the most distinct instructions "
          "(distinct, executed per call, object, function):")
    for ((o, fn), n), name in zip(rows, demangled):
        print(f"  {n:5d} {ir_fn[(o, fn)] / calls:7.0f}  {o[:24]:24s} {name[:140]}")
    print_calls(short_calls, long_calls, calls, top)
    if binary:
        import os
        lines(per, long_, binary, (root or os.getcwd()).rstrip("/") + "/", top)


if __name__ == "__main__":
    main()
