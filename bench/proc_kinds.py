"""`bench/proc_cpu.py`'s per-process lines summed by kind of process: `python bench/proc_kinds.py PROCS.txt`.

A kind is read from the command line (a trainer worker, a checkpoint writer started by multiprocessing's spawn or
forked by the node's fork server, whose children `proc_cpu.py` names by their process name, a launcher, a pytest
process, ...); prints each kind's CPU seconds, its number of processes and the mean."""

from __future__ import annotations

import re
import sys
from collections import defaultdict

KINDS = (  # the first pattern a command line matches names its kind
    (r"^\[fork-worker\]", "trainer worker (forked by the node's fork server)"),
    (r"^\[fork-process\]", "checkpoint writer or warm standby (forked by the node's fork server)"),
    (r"trainer\.forkserver", "fork server"),
    (r"spawn_main", "checkpoint writer (multiprocessing spawn)"),
    (r"trainer\.standby", "warm standby (spawned), or the standby server"),
    (r"ft_launcher|trainer\.resiliency\.launch", "launcher (entrypoint.sh's ft_launcher)"),
    (r"torchrun|torch\.distributed\.run", "torchrun"),
    (r" -m trainer( |$)|trainer/__main__", "trainer worker (python -m trainer)"),
    (r" -m trainer\.\w+", "other trainer module (evaluate, export, plan)"),
    (r"xdist|execnet|exec\(eval\(", "pytest-xdist worker (the tests' own code)"),
    (r"pytest", "pytest (collection, xdist's controller)"),
    (r"components|kfp|pipelines", "pipeline step (kfp.local)"),
)


def kind(cmd: str) -> str:
    return next((name for pattern, name in KINDS if re.search(pattern, cmd)), "other")


def main(path: str) -> int:
    lines = open(path).read().splitlines()
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for line in lines:
        m = re.match(r"\s*([\d.]+) (\d+) (.*)", line)
        if m:
            sums[kind(m[3])][0] += 1
            sums[kind(m[3])][1] += float(m[1])
    print(next((line for line in lines if line.startswith("wall ")), ""))
    for name, (count, cpu) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
        print(f"{cpu:8.1f} CPU-s {int(count):5d} processes ({cpu / count:4.2f} each)  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
