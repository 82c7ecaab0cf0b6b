#!/usr/bin/env python3
"""Where each stack's own cost per call goes, by the source its instructions come from.

    cargo build --release -p backstop-bench --bin per_call
    tools/bench/cost_by_source.py [--realistic] STACK [STACK ...]      # e.g. tower retry-budget-timeout-leaf

Each stack (a name `per_call` takes) runs under callgrind at 2,000 and 12,000 calls, and so does
the bare call; `callgrind_annotate` gives each function's self cost, and inlined code is counted
under the source file it comes from (`crates/backstop-retry/src/future.rs`, tower's
`retry/future.rs`, libc's `memcpy`), whatever function it was inlined into. Per call is the
difference between the two runs over 10,000 calls, less the bare call's, so set-up and the
request the bench builds cancel out. Run it from the workspace's root (see BENCHMARKS.md: the
working directory's length moves the copies' counts by a few instructions).
"""
import os, re, subprocess, sys, tempfile
from collections import defaultdict

BIN = os.path.join("target", "release", "per_call")
LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*?):(.*?)(?:\s+\[[^\]]*\])?$")


def group(path, function):
    """The group a function's self cost is counted in: the crate or job its source belongs to."""
    if re.search(r"mem(move|cpy|set)", path + function):
        return "moves and fills (libc memcpy/memset)"
    if "malloc" in path or re.search(r"\b(free|malloc|realloc)\b", function):
        return "allocator (libc)"
    m = re.search(r"(?:^|/)crates/(backstop[\w-]*)/src/(.*)", path)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    m = re.search(r"/(tower-resilience|tower|tokio|http|bytes|tracing[\w-]*)-\d[^/]*/src/(\w+)", path)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    if "/library/" in path:
        return "drops (drop glue)" if "drop_in_place" in function else "std, inlined"
    if re.search(r"(?:^|/)tools/bench/", path):
        return "the bench's loop and service"
    return "other: " + os.path.basename(path)


def self_costs(stack, calls, realistic):
    with tempfile.NamedTemporaryFile(suffix=".cg", delete=False) as f:
        out = f.name
    try:
        args = [BIN, stack, str(calls)] + (["realistic"] if realistic else [])
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + args,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        text = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", out],
                              check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(out)
    costs = defaultdict(int)
    for line in text.splitlines():
        m = LINE.match(line)
        if m and "PROGRAM TOTALS" not in line and "=>" not in line:
            costs[group(m.group(2), m.group(3))] += int(m.group(1).replace(",", ""))
    return costs


def per_call(stack, realistic):
    few, many = self_costs(stack, 2000, realistic), self_costs(stack, 12000, realistic)
    return {g: (many[g] - few.get(g, 0)) / 10000 for g in set(few) | set(many)}


def main():
    args = sys.argv[1:]
    realistic = "--realistic" in args
    stacks = [a for a in args if a != "--realistic"]
    if not stacks:
        sys.exit(__doc__)
    bare = per_call("bare", realistic)
    own = {s: {g: c - bare.get(g, 0) for g, c in per_call(s, realistic).items()} for s in stacks}
    groups = sorted({g for o in own.values() for g in o},
                    key=lambda g: -max(abs(o.get(g, 0)) for o in own.values()))
    print("| where | " + " | ".join(stacks) + " |")
    print("|---|" + "---:|" * len(stacks))
    for g in groups:
        row = [round(own[s].get(g, 0)) for s in stacks]
        if any(abs(c) >= 3 for c in row):
            print(f"| {g} | " + " | ".join(f"{c:,}" for c in row) + " |")
    print("| **own cost** | " + " | ".join(f"**{round(sum(own[s].values())):,}**" for s in stacks) + " |")


if __name__ == "__main__":
    main()
