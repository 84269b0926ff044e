"""Where `make test`'s CPU goes: a pytest plugin recording each test's wall time and CPU time (its pytest process's
own, and that of the processes it started and waited for: launchers, workers, writers), and a summary by module.

    PYTHONPATH=bench PYTEST_CPU_OUT=/tmp/test-cpu.jsonl make test PYTEST_ARGS="-p pytest_cpu"
    python bench/pytest_cpu.py /tmp/test-cpu.jsonl

A module-scoped fixture's run counts in the first test that uses it. Processes no test process waited for (a
daemon's, a double fork's) and each pytest process's collection are not counted."""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest


def _cpu() -> tuple[float, float]:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 - the hook's signature
    wall, (own, waited) = time.monotonic(), _cpu()
    yield
    own_after, waited_after = _cpu()
    record = {"id": item.nodeid, "wall": round(time.monotonic() - wall, 2), "self": round(own_after - own, 2),
              "children": round(waited_after - waited, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER")}
    with open(os.environ.get("PYTEST_CPU_OUT", "test-cpu.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")


def summary(path: str) -> None:
    """CPU-seconds and wall seconds by test module, the most CPU first."""
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for line in open(path):
        record = json.loads(line)
        entry = modules[record["id"].split("::", 1)[0]]
        entry[0] += record["self"] + record["children"]
        entry[1] += record["wall"]
        entry[2] += 1
    print(f"{'CPU s':>8} {'wall s':>8} tests module")
    for module, (cpu, wall, count) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.1f} {wall:8.1f} {count:5d} {module}")
    print(f"{sum(m[0] for m in modules.values()):8.1f} {sum(m[1] for m in modules.values()):8.1f} "
          f"{sum(m[2] for m in modules.values()):5d} in all")


if __name__ == "__main__":
    summary(sys.argv[1])
