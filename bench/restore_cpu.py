"""The host-side time of a restore from the memory and node-local tiers, on CPU: ``CheckpointManager.load_latest``
for a model with the ``1b`` flavour's tensor count (16 blocks: 147 parameters, 441 optimizer tensors) at a tiny width,
so what it measures is the restore's Python and unpickling work, not a copy. Two cases, each ``--runs`` times:

- ``in-process``: the same manager restores into a fresh model and optimizer (an in-process restart);
- ``new process``: a second manager, with no header read yet in this process, restores what the first one
  published (an in-job restart's worker).

Prints one JSON line per case: the median and each run's seconds, and the snapshot headers unpickled per restore;
then ``header read``: one published header read (``snapshot_header.decode_header``, its tables as JSON) against the
same header saved with its tables as objects and read weights-only (format 1), the median of ``--runs`` x 5 reads.

    .venv/bin/python bench/restore_cpu.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "tests" / "checkpoint"), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import statelib  # noqa: E402
from trainer.checkpoint import snapshot_header  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402

statelib.MODEL = ModelConfig(name="blocks16", dim=64, n_layers=16, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    loads: list[str] = []
    real_load = torch.load

    def counting(path, *a, **kw):
        if str(path).endswith(".meta"):
            loads.append(str(path))
        return real_load(path, *a, **kw)

    torch.load = counting  # every header read goes through torch.load
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        state = statelib.make_state()
        mgr = statelib.manager(directory, persist_every=0, memory_slots=3)
        for step in (1, 2, 3):
            statelib.train_step(state, step)
            mgr.save(step, state)
        for slot in mgr.snapshots.slots:
            slot.published.wait(60)
        cases: dict[str, list[tuple[float, int]]] = {"in-process": [], "new process": []}

        def restore(case: str, mgr, seed: int) -> None:
            """One restore of step 3 into a fresh state: (seconds, headers unpickled) under ``case``."""
            fresh = statelib.make_state(seed=seed)
            loads.clear()
            began = time.perf_counter()
            assert mgr.load_latest(fresh) == 3
            cases[case].append((time.perf_counter() - began, len(loads)))

        for _ in range(args.runs):
            mgr.unbind()  # an in-process restart: the same manager, a new attempt
            mgr.bind()
            restore("in-process", mgr, seed=3)
        header_read = _header_reads(mgr.snapshots.newest().meta_path, directory, args.runs * 5)
        mgr.close()
        for _ in range(args.runs):
            snapshot_header._HEADERS.clear()  # a new process has read no header
            respawned = statelib.manager(directory, memory_slots=3)
            restore("new process", respawned, seed=5)
            respawned.close()
    for case, runs in cases.items():
        seconds = [s for s, _ in runs]
        print(json.dumps({"figure": "restore_cpu", "case": case, "median_s": round(statistics.median(seconds), 4),
                          "runs_s": [round(s, 4) for s in seconds], "headers_unpickled": [n for _, n in runs]}))
    print(json.dumps({"figure": "restore_cpu", "case": "header read", **header_read}))
    dist.destroy_process_group()


def _header_reads(path: Path, directory: Path, runs: int) -> dict[str, float]:
    """Median seconds to read the header at ``path`` as stored, and saved with its tables as objects."""
    meta = snapshot_header.decode_header(path)
    objects = directory / "objects.meta-bench"
    torch.save(meta, objects)
    times: dict[str, list[float]] = {"json_tables_s": [], "objects_s": []}
    for _ in range(runs):
        for key, read in (("json_tables_s", lambda: snapshot_header.decode_header(path)),
                          ("objects_s", lambda: torch.load(objects, map_location="cpu", weights_only=True))):
            began = time.perf_counter()
            read()
            times[key].append(time.perf_counter() - began)
    objects.unlink()
    return {key: round(statistics.median(values), 5) for key, values in times.items()}


if __name__ == "__main__":
    main()
