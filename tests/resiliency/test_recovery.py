"""Faults injected into 2-rank gloo runs of the tiny model; each run must end bit-identical to a fault-free run.

Short CPU timeouts (gloo 2 s < soft 4 s < hard 8 s < ft_launcher heartbeat 30 s; 3 < 6 < 12 s in
test_recovery_exits, whose ranks start under the load of the other tests) keep the directory within a few
minutes on 2 cores. After every scenario: no process, listening port or /dev/shm entry of
the run is left behind.
"""

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from testlib import MICRO_MODEL, REPO, fault_seed, free_port, run_session
from trainer.checkpoint import FAULT_ENV, load_model_weights
from trainer.ledger import read

# Serial: each test counts the recoveries of its run exactly. Under two tests' load on 2 cores a rank once took an
# extra in-process restart before its first step (hang_gil, 1 of 3 runs): an OSError(9) from trainer.parallel's
# gloo-connection scan, fixed (trainer.parallel._borrow, tests/resiliency/test_units.py). The in-process recovery's
# phases then missed its recovery_s by 76 ms, fixed (trainer/ledger.py). Two at a time, 2 group runs passed, but the
# third (CI, dd8acfc) saw two restart records for rank 0 in the SIGTERM test's relaunch: so it stays one at a time.
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

VENV_BIN = Path(sys.executable).parent
ENTRYPOINT = REPO / "trainer_image" / "entrypoint.sh"
STEPS = 10
# Small batches (2 x 64 tokens per rank, ~8x cheaper steps than the tiny preset's 8 x 128) of the micro model (a 40-step
# 2-rank run: 14 CPU-s against 24 with the tiny one): what these tests check (recovery, tiers, exit codes, bit-identical
# weights against the reference run of the same arguments) depends on neither, and on a 2-core machine the steps' CPU
# time no longer dominates each launch.
SMALL_BATCHES = ["--train.batch_size=2", "--data.seq_len=64"]
# test_node_memory runs the preset as it is: its watch must see the run for seconds before it kills a worker.
PRESET = ["--config", "tiny", "--train.steps=%d" % STEPS, "--checkpoint.interval=2", "--checkpoint.keep=3"]
TINY_BASE = [*PRESET, *SMALL_BATCHES]
BASE = [*TINY_BASE, *MICRO_MODEL]


def inprocess(collective_s, soft_s, hard_s, grace_s):
    """The in-process layer's flags, its timeouts nested: collective < soft < hard (+ grace) < FT_ENV's heartbeat."""
    assert collective_s < soft_s < hard_s and hard_s + grace_s + 10 < int(FT_ENV["FT_RANK_HEARTBEAT_TIMEOUT"])
    return ["--resiliency.inprocess=true", f"--resiliency.collective_timeout_s={collective_s}",
            f"--resiliency.soft_timeout_s={soft_s}", f"--resiliency.hard_timeout_s={hard_s}",
            "--resiliency.heartbeat_timeout_s=10", f"--resiliency.termination_grace_s={grace_s}"]


FT_ENV = {  # nest outward: ft heartbeat 30 s > hard timeout + grace + margin 10 s (INJOB_MARGIN_S) for both sets below
    "FT_RANK_HEARTBEAT_TIMEOUT": "30", "FT_INITIAL_RANK_HEARTBEAT_TIMEOUT": "60", "FT_WORKLOAD_CHECK_INTERVAL": "1",
    "FT_WORKERS_STOP_TIMEOUT": "5", "FT_TERM_TIMEOUT": "20",
}
GRACE = ["--resiliency.preemption_grace_s=10"]
# test_recovery_exits starts its ranks two at a time with other tests: a rank's start may lag the other's by seconds.
INPROCESS = inprocess(collective_s=3, soft_s=6, hard_s=12, grace_s=2)
# This module's runs have the machine to themselves (serial), and a hang ends only at a timeout (hang_gil: hard +
# grace; the GIL-free hang: soft), so theirs are shorter: with 12 + 2 s and soft 6 s the hang_gil test took 24 s
# (alone), with these 19 s; the in-process launch ~2 s less.
HARD_S = 8
HANGS = inprocess(collective_s=2, soft_s=4, hard_s=HARD_S, grace_s=1)


def _run(cmd, run_dir, env_extra=None, timeout=150):
    """Run a launcher in its own session; returns (returncode, output, port). Kills the process session on timeout."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **(env_extra or {})}
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    shm_before = set(os.listdir("/dev/shm"))
    rc, out = run_session(cmd, env, timeout, f"timed out after {timeout} s")
    _assert_nothing_left(run_dir, port, shm_before)
    return rc, out, port


def node_dir(run_dir):
    """The run's node-local snapshot directory (instead of /dev/shm, so the leak check sees only this run)."""
    return Path(f"{run_dir}-node")


def torchrun(run_dir, dataset, *args, **kw):
    cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node=2", "--master-port={port}", "-m", "trainer", *BASE,
           f"--data.path={dataset}", f"--train.run_dir={run_dir}", f"--checkpoint.node_local_dir={node_dir(run_dir)}",
           *args]
    return _run(cmd, run_dir, **kw)


def entrypoint(run_dir, dataset, *args, env=None, **kw):
    cmd = [str(ENTRYPOINT), *BASE, f"--data.path={dataset}", f"--train.run_dir={run_dir}",
           f"--checkpoint.node_local_dir={node_dir(run_dir)}", *args]
    return _run(cmd, run_dir, env_extra={**FT_ENV, **(env or {})}, **kw)


def _pids_of(run_dir):
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(run_dir) in cmdline and int(entry) != os.getpid():
                pids.append(int(entry))
    return pids


def _listening_ports():
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _assert_nothing_left(run_dir, port, shm_before):
    deadline = time.monotonic() + 10  # NVRx monitor daemons and checkpoint writers exit asynchronously
    while (left := _pids_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    busy = _listening_ports() & {port, port + 1, port + 2}
    assert not busy, f"ports still listening: {busy}"
    leaked = [name for name in set(os.listdir("/dev/shm")) - shm_before
              if any(str(pid) in name for pid in _pids_in_ledger(run_dir))]
    assert not leaked, f"/dev/shm entries left: {leaked}"
    snapshots = [str(p) for p in node_dir(run_dir).rglob("*")] if node_dir(run_dir).is_dir() else []
    assert not snapshots, f"node-local snapshots left after the job ended: {snapshots}"


def _pids_in_ledger(run_dir):
    return {r["pid"] for r in read(Path(run_dir) / "recovery.jsonl")}


def assert_same_weights(run_dir, reference):
    weights = load_model_weights(Path(run_dir) / "checkpoints")
    assert weights.keys() == reference.keys()
    for key in reference:
        assert torch.equal(weights[key], reference[key]), f"{key} differs from the fault-free run"


def events(run_dir, kind):
    return [r for r in read(Path(run_dir) / "recovery.jsonl") if r["event"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dataset):
    run_dir = tmp_path_factory.mktemp("reference")
    rc, out, _ = torchrun(run_dir, tiny_dataset)
    assert rc == 0, out[-4000:]
    return load_model_weights(run_dir / "checkpoints")


def test_hang_holding_the_gil_is_recovered_in_job(tmp_path, tiny_dataset, reference):
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *HANGS, *GRACE, "--resiliency.faults=1:5:hang_gil")
    assert rc == 0, out[-4000:]
    (recovered,) = events(tmp_path, "recovered")
    assert recovered["layer"] == "injob" and recovered["fault_kind"] == "hang_gil"
    assert recovered["recovery_s"] < 30 + 30, "hard timeout (or ft heartbeat timeout) plus a restart"
    assert_same_weights(tmp_path, reference)


def test_a_sigkill_and_an_oom_kill_are_recovered_in_job(tmp_path, tiny_dataset, reference):
    # The SIGKILL lands at the start of step 4, not 3: a kill in the first milliseconds after the first snapshot
    # (step 2) can beat its node-local publication (a background thread), and with no earlier snapshot the respawn
    # rightly starts from scratch (CI saw it once). One fault of each kind, on each rank (test_nodes kills rank 0 on
    # another node): each respawn is a new worker generation, the costliest part of this module's time.
    faults = "0:4:sigkill,1:7:oom"
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *GRACE, f"--resiliency.faults={faults}", timeout=240)
    assert rc == 0, out[-4000:]
    recovered = events(tmp_path, "recovered")
    assert [(r["fault_kind"], r["fault_step"]) for r in recovered] == [("sigkill", 4), ("oom", 7)]
    assert {r["layer"] for r in recovered} == {"injob"}
    assert [r["attempt"] for r in recovered] == [1, 2]
    for r in recovered:  # where the seconds went, from the fault to the end of the first step
        assert {"before_start", "import", "resources", "wrapper", "restore", "first_step"} <= set(r["phases"])
        assert r["phases"]["before_start"] + r["phases"]["total"] == pytest.approx(r["recovery_s"], abs=0.05)
    restarts = events(tmp_path, "restart")
    assert {r["tier"] for r in restarts} == {"node-local"}, "a respawned worker resumes from host memory on its node"
    assert_forked(tmp_path, out, attempts=3)
    assert_same_weights(tmp_path, reference)


def test_an_exception_resumes_in_process_from_the_last_whole_step(tmp_path, tiny_dataset, reference):
    """An exception outside ``optimizer.step()`` leaves the last finished step whole in memory: the failed attempt's
    end snapshots it (``trainer/checkpoint/atfault.py``) and both ranks resume from it, not from the last memory
    checkpoint, where that saves 2 or more steps; the run still ends bit-identical to the fault-free one. Memory
    checkpoints every 5 steps; the exception (rank 1) lands 2 to 4 steps after the one of step 5, as drawn: 1 step
    behind it leaves the checkpoint as the restore point, 2 or 3 the step before the fault."""
    seed = fault_seed()
    at = random.Random(seed).randint(7, 9)
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *INPROCESS, *GRACE, "--checkpoint.interval=5",
                            f"--resiliency.faults=1:{at}:exception")
    assert rc == 0, f"FAULT_SEED={seed} {out[-4000:]}"
    whole = at - 1 if at - 1 - 5 >= 2 else 5
    restarts = events(tmp_path, "restart")
    assert sorted((r["rank"], r["layer"], r["resumed_step"], r["tier"]) for r in restarts) == [
        (rank, "inprocess", whole, "memory") for rank in (0, 1)], f"FAULT_SEED={seed} {restarts}"
    (recovered,) = events(tmp_path, "recovered")
    assert recovered["steps_redone"] == at - 1 - whole, f"FAULT_SEED={seed} {recovered}"
    staged = re.findall(r"snapshot of step (\d+), the last whole step before the fault, staged", out)
    assert staged == ([str(whole)] * 2 if whole != 5 else []), f"FAULT_SEED={seed} {out[-4000:]}"
    assert_same_weights(tmp_path, reference)


def assert_forked(run_dir, out, attempts):
    """Every worker of every attempt, and every checkpoint writer, came from the node's fork server (on by default
    in entrypoint.sh, trainer/startup/forkserver.py): the ledger's processes (which record the exit codes) are the
    forked ones, and each attempt's writer was forked during its worker's restore, before its first step ended, so before
    any persist of that attempt."""
    assert re.search(r"forkserver: ready in [\d.]+ s", out), out[-4000:]
    forked = {int(p) for p in re.findall(r"forked by the node's fork server \(pid (\d+)\) for local rank", out)}
    assert len(forked) == 2 * attempts, out[-4000:]
    assert "starting normally" not in out and "starts the ordinary way" not in out, out[-4000:]
    assert _pids_in_ledger(run_dir) <= forked, "the ledger's (and the exit-code files') processes are the forked ones"
    assert f"workers' codes (attempt {attempts - 1}): 0 0; exiting 0" in out, "the forked workers recorded their codes"
    for rank in (0, 1):
        log = (Path(run_dir) / "logs" / f"trainer-rank{rank}.log").read_text().splitlines()
        writers = [i for i, line in enumerate(log) if "checkpoint writer forked by the node's fork server" in line]
        starts = [i for i, line in enumerate(log) if "start phases (s)" in line]
        assert len(writers) == len(starts) == attempts, "one writer per attempt"
        assert all(w < s for w, s in zip(writers, starts)), "each writer forked before its worker's first step ended"


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tiny_dataset, reference):
    """Step 6's checkpoint (synchronous saves: committed at step 6) is corrupted at the start of step 7 while the
    other rank is SIGKILLed there; with the node-local tier off the restart reads the disk: it must quarantine
    step 6, resume from step 4, and still end bit-identical."""
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *GRACE, "--checkpoint.node_local=false",  # the disk is read
                            "--checkpoint.async_save=false", "--resiliency.faults=0:7:corrupt_checkpoint,1:7:sigkill")
    assert rc == 0, out[-4000:]
    ckpt = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.glob("step-00000006.corrupt-*")] == ["step-00000006.corrupt-checksum-mismatch"]
    assert "step-00000006" in out and "checksum" in out  # the loud log line names the checkpoint and the reason
    restarts = [r for r in events(tmp_path, "restart") if r["rank"] == 0]
    assert [(r["layer"], r["resumed_step"], r["tier"]) for r in restarts] == [("injob", 4, "disk")]
    assert_same_weights(tmp_path, reference)


STALL_S = 8  # the final save's stall: past the learned heartbeat timeout (5 s, its bound: resiliency.heartbeat)


def test_a_slow_disk_costs_no_snapshot_and_a_sigkill_resumes_from_the_newest(tmp_path, tiny_dataset, reference):
    """Every persistent write stalls 3 s, far longer than a memory interval (2 steps): the memory tier still takes
    every snapshot (only the slot being written is held), so rank 0's SIGKILL at the start of step 10 resumes from
    step 8 on the node, not from an older persisted checkpoint. (Not at the start of step 9: that is microseconds
    after step 8's snapshot, whose node-local header is published in the background, and a kill before it lands
    rightly falls back to the newest snapshot every rank published.)

    The final save then stalls 8 s on the disk, past the heartbeat timeout learned from the steps (its bound, 5 s):
    the ranks keep heartbeating while they wait (checkpoint.min_write_mbps's budget), so ft_launcher does not
    restart them into the same wait: the SIGKILL's is the run's only restart."""
    rc, out, _ = entrypoint(tmp_path, tiny_dataset, *GRACE, "--resiliency.faults=0:10:sigkill",
                            env={FAULT_ENV: f"slow_write:3,slow_write:{STALL_S}@{STEPS}"})
    assert rc == 0, out[-4000:]
    restarts = [r for r in events(tmp_path, "restart") if r["rank"] == 0]
    assert [(r["layer"], r["resumed_step"], r["tier"]) for r in restarts] == [("injob", 8, "node-local")], out[-4000:]
    assert "persistent tier behind" in out and not re.search(r"memory checkpoint of step \d+ skipped", out)
    learned = [float(s) for s in re.findall(r"in-job heartbeat timeouts: .*subsequent=([\d.]+)", out)]
    assert learned and max(learned) < STALL_S, "the stall must outlast the learned heartbeat timeout"
    assert "Did not get subsequent heartbeat" not in out and len(events(tmp_path, "recovered")) == 1, out[-4000:]
    assert_same_weights(tmp_path, reference)
