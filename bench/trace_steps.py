"""Where the device time of each profiled step went, from a ``train.profile_steps`` trace (Chrome JSON, .gz or not).

``python bench/trace_steps.py runs/x/profile/rank0-steps69-72.json.gz`` prints one JSON line per step
(``figure: trace_step``): the step's device range, the training stream's busy time (kernels, copies, memsets), its
idle gaps over 0.1 ms split into host-bound (the next op was launched after the stream went idle) and device-bound
(launched in time, waiting for something on the device, e.g. a copy engine), the largest gaps with the op after
each, and the other streams' work that started inside the step (by kind: count, milliseconds, first start).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def steps(events: list[dict]) -> list[dict]:
    ranges = [e for e in events if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("step ")]
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    work = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not work:
        raise SystemExit("no device activity in this trace (a CPU run): open it in Perfetto for the host side")
    counts: dict[int, int] = defaultdict(int)
    for e in work:
        counts[e["args"].get("stream")] += 1
    training = max(counts, key=counts.__getitem__)  # the stream with the most work
    out = []
    # a range is annotated on every stream that ran work inside it (e.g. a drain's copies): the training stream's
    for r in sorted((r for r in ranges if r.get("tid") == training), key=lambda e: e["ts"]):
        begin, end = r["ts"], r["ts"] + r["dur"]
        inside = [e for e in work if begin <= e["ts"] < end]
        mine = [e for e in inside if e["args"].get("stream") == training]
        gaps, host_bound, device_bound, busy_until = [], 0.0, 0.0, None
        for e in mine:
            if busy_until is not None and e["ts"] - busy_until > 100:
                gap = e["ts"] - busy_until
                launch = launches.get(e["args"].get("correlation"))
                late = launch is not None and launch["ts"] + launch["dur"] > busy_until
                host_bound += gap if late else 0.0
                device_bound += 0.0 if late else gap
                gaps.append((gap, "host" if late else "device", e["name"][:48], round((e["ts"] - begin) / 1e3, 2)))
            busy_until = max(busy_until or 0.0, e["ts"] + e["dur"])
        others: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, float("inf")])
        for e in inside:
            if e["args"].get("stream") != training:
                kind = f"stream {e['args'].get('stream')}: {e['name'][:40]}"
                others[kind][0] += 1
                others[kind][1] += e["dur"]
                others[kind][2] = min(others[kind][2], e["ts"] - begin)
        out.append({
            "figure": "trace_step", "step": r["name"], "device_ms": round(r["dur"] / 1e3, 2),
            "training_stream": training, "busy_ms": round(sum(e["dur"] for e in mine) / 1e3, 2),
            "gaps_host_bound_ms": round(host_bound / 1e3, 2), "gaps_device_bound_ms": round(device_bound / 1e3, 2),
            "largest_gaps": [[round(g / 1e3, 2), why, name, at] for g, why, name, at in sorted(gaps, reverse=True)[:4]],
            "other_streams": {k: {"count": v[0], "ms": round(v[1] / 1e3, 2), "first_at_ms": round(v[2] / 1e3, 2)}
                              for k, v in others.items()},
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    for record in steps(load(parser.parse_args().trace)):
        print(json.dumps(record))


if __name__ == "__main__":
    main()
