"""The planner's documented defaults: what it charges for an input no ledger measured, where each value comes from,
and the command that would measure it. The report prints every default used beside the result (``plan.report``),
and the uncertainty band varies each by ±50 % (``band``).

Each value is a figure BENCHMARKS.md records with its card, date, commit and command, or a Kubernetes default;
``PLANNING.md`` ("The inputs it needs") lists them in a table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Default:
    value: float | None
    """None: derived from the run's own measured inputs, as ``source`` says (``costs``)."""
    source: str
    """Where the value comes from (printed)."""
    measure: str
    """The command that measures it instead (printed)."""


_H200_1B = "one H200, 1b eager (an 18 GB state)"
_PEER_BENCH = ("PYTHONPATH=.:trainer_image:tests .venv/bin/python bench/peer_nodes.py --plan {plan} --config tiny "
               "--steps 40 --interval 4 --train.batch_size=2 --data.seq_len=64 --train.cpu_threads=1 (two CPU nodes; "
               "on two GPUs: bash bench/gpu_suite.sh peer), then plan --measured <its run directories>")
_START_S, _DISK_READ_S = 11.45, 14.92

DEFAULTS: dict[str, Default] = {
    "recovery_inprocess": Default(
        0.83, f"an in-process restart on {_H200_1B}, fault to first productive step less one step (1.103 - 0.274 s; "
        "bench/results/goodput/h200-2026-12-04-69ff96c/figures.jsonl)",
        "a run with an injected exception: --train.faults / the pipeline's faults=0:N:exception"),
    "recovery_injob": Default(
        1.36, f"an in-job restart (SIGKILL, warm standby) on {_H200_1B}, less one step (1.633 - 0.274 s; "
        "bench/results/goodput/h200-2026-12-04-69ff96c/figures.jsonl)",
        "a run with an injected SIGKILL: faults=0:N:sigkill"),
    "recovery_node": Default(
        _START_S + _DISK_READ_S, f"a lost node restored from the persistent tier on {_H200_1B}: a new process's start "
        f"to its first step ({_START_S} s, bench/results/goodput/h200-2026-12-04-20cd5dd/figures.jsonl 'start') + "
        f"one state read from disk ({_DISK_READ_S} s, disk_load in "
        "bench/results/snapshot-cost/h200-2026-12-01-e97fdf8/recovery-checkpoint-figures.jsonl)",
        _PEER_BENCH.format(plan="lost:0")),
    "recovery_cluster": Default(
        58.8, "the CPU demo's cluster restart, a preemption and the pipeline's retry (make demo; "
        "tests/unit/planner_data/demo-run, fault to first productive step)",
        "make demo, then plan --measured <the demo's run directory>"),
    "restore_persistent_s": Default(
        _DISK_READ_S, f"one state read from disk on {_H200_1B} (disk_load in "
        "bench/results/snapshot-cost/h200-2026-12-01-e97fdf8/recovery-checkpoint-figures.jsonl)",
        _PEER_BENCH.format(plan="lost:0")),
    "restore_memory_s": Default(
        0.0, "not subtracted: the in-job restart's restore phase is not in this ledger (a trainer older than the "
        "restart phases)", "a run with an injected SIGKILL (its recovered record's phases.restore)"),
    "publish_s": Default(
        None, "3 steps on a GPU (the device-to-host copy drains over the steps after a snapshot), 0 on CPU",
        "not measured by a harness: --cost publish_s=SECONDS"),
    "persist_write_s": Default(
        None, "the run's final save (a synchronous write of one state) standing in for a background write",
        "a run with checkpoint.persist_every > 0 on a trainer that writes 'persisted' records"),
    "persist_overhead_s": Default(
        0.0, "not measured: the steps' slowdown while a background write runs, taken as 0",
        "a run with checkpoint.persist_every > 0 on a trainer that writes 'persisted' records"),
    "peer_copy_s": Default(
        None, "one snapshot's measured cost per replica, in the background (a copy sends the bytes the snapshot "
        "landed in host memory)", _PEER_BENCH.format(plan="clean:0,clean:auto")),
    "peer_lag_s": Default(
        None, "one snapshot interval: a replica is taken as usable by the next snapshot",
        _PEER_BENCH.format(plan="clean:auto") + " (the metrics summary's replica_push)"),
    "peer_restore_s": Default(
        None, "the node layer's restore from the persistent tier (a peer's memory taken as no faster)",
        _PEER_BENCH.format(plan="lost:auto")),
    "replacement_s": Default(
        350.0, "Kubernetes' defaults: a node is marked unreachable after node-monitor-grace-period (50 s since "
        "1.32, 40 s before) and its pods are evicted after the default toleration of 300 s "
        "(DefaultTolerationSeconds), when the replacement pod can be created; scheduling and the image pull not "
        "included (a lower bound)", "time a replacement pod on the cluster: --replacement-s SECONDS"),
}
