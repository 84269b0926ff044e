"""Every recovery layer across nodes: two ``entrypoint.sh`` processes as two nodes (one worker each, the micro model on
gloo, each node its own node-local directory and address; ``nodeharness``), every run ending bit-identical to a
fault-free run of the same ranks.

One run takes a fault of every kind in turn, so the suite pays for one start: an exception and a GIL-free hang
(in-process), a SIGKILL (in-job), a worker stopped with SIGSTOP (a hung node: its heartbeats stop, the in-job layer
restarts every node), the ``node_lost`` fault (a node and its memory gone; the harness starts the replacement pod),
the loss of the node hosting the rendezvous's store (the other node joins the rendezvous again; after each loss the
new node's rank fetches its state from the replica in the other node's memory, the peer tier), and a preemption
(SIGTERM to every pod: both exit 202, then both are started again and resume: the cluster layer); then a node started
again after the run ended, which exits 0 at once. One more run: a permanent error on one node (every node stops after
one attempt with its code). Every fault's step is drawn anew each run, so each lands at one distance or another from a
snapshot; the seed is in every failure's message. Nothing of a run is left in node memory (``/dev/shm``): a lost
node's is removed with it, as its pod's would be. (A node lost at a moment drawn in wall-clock time, start and end
included: ``drill_kill_anytime.py``, run by hand.)
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import torch

from nodeharness import Cluster
from test_recovery import BASE, FT_ENV, GRACE, HANGS, HARD_S, events, torchrun
from testlib import fault_seed
from trainer.checkpoint import load_model_weights
from trainer.exitcodes import ExitCode

pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

STEPS = 40  # the micro model's steps are fast: the SIGTERM (step 29-31) must still land before the end
# One thread per worker: the reference runs both ranks on one node, where the default would give each half the cores
# (and so other sums in the matmuls) than a node of one worker does.
ARGS = [*(a for a in BASE if not a.startswith("--train.steps")), f"--train.steps={STEPS}", "--train.cpu_threads=1",
        *GRACE, *HANGS, "--checkpoint.memory_slots=3"]  # the peer tier: checkpoint.replicas=auto (1 with two nodes)
"""Three snapshot slots: while the newest snapshot's replica is still on its way, a lost node's rank falls back to the
one before it, and with two slots and a persistent write in flight that is the slot being written, however old (for
the first seconds after each restart, while the writer process starts; CI: 6 steps redone). A third slot keeps the
snapshot before the newest, so every bound here holds whatever the disk's speed (``checkpoint.memory_slots``)."""
ENV = {**FT_ENV, "FT_RDZV_KEEP_ALIVE_S": "1", "FT_MAX_RESTARTS": "6"}
SEED = fault_seed()
DRAW = random.Random(SEED)
EXCEPTION_AT, KILLED_AT, HANG_AT, NODE_LOST_AT = (DRAW.randint(3, 5), DRAW.randint(6, 8), DRAW.randint(9, 11),
                                                  DRAW.randint(18, 20))
"""The injected faults' steps: each lands 0 or 1 steps after a snapshot (every 2 steps), as drawn."""
FAULTS = f"1:{EXCEPTION_AT}:exception,0:{KILLED_AT}:sigkill,1:{HANG_AT}:hang,0:{NODE_LOST_AT}:node_lost"
REDONE_MAX = 2 + 2
"""Steps redone after a fault at most: an interval, and one more when the fault beat the newest snapshot's node-local
publication or a new process's first snapshot waited for its slot (both fall back to the snapshot before)."""
STOPPED_AT = DRAW.randint(13, 15)
"""The step at which a worker is stopped (SIGSTOP): a hung node."""
HOST_LOST_AT = DRAW.randint(23, 26)
"""The step at which the node hosting the rendezvous's store is lost."""
PREEMPTED_AT = DRAW.randint(29, 31)
"""The step at which every pod gets SIGTERM."""
WHY = f"(seed {SEED}: faults {FAULTS}, SIGSTOP at step {STOPPED_AT}, store host lost at step {HOST_LOST_AT}, " \
      f"SIGTERM at {PREEMPTED_AT})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dataset):
    """The fault-free run: the same two ranks under torchrun on one node (the arithmetic does not see the nodes)."""
    run_dir = tmp_path_factory.mktemp("reference")
    rc, out, _ = torchrun(run_dir, tiny_dataset, *(a for a in ARGS if a not in BASE), f"--train.steps={STEPS}")
    assert rc == 0, out[-4000:]
    return load_model_weights(run_dir / "checkpoints")


def assert_same_weights(run_dir, reference):
    weights = load_model_weights(run_dir / "checkpoints")
    for key in reference:
        assert torch.equal(weights[key], reference[key]), f"{key} differs from the fault-free run {WHY}"


@pytest.fixture(scope="module")
def layered(tmp_path_factory, tiny_dataset):
    base = tmp_path_factory.mktemp("layered")
    with Cluster(base, tiny_dataset, 2, 1, [*ARGS, f"--resiliency.faults={FAULTS}"], env=ENV) as cluster:
        cluster.start_all()
        cluster.wait_for_step(STOPPED_AT)
        stopped = cluster.nodes[1].workers()
        assert stopped, cluster.tail()
        os.kill(stopped[0], signal.SIGSTOP)
        stopped_at = time.time()
        cluster.wait_for_step(HOST_LOST_AT, timeout=180)
        host = next(n for n in reversed(cluster.nodes) if not n.lost and "hosts the TCP store" in n.output())
        lost_at = time.time()
        survivor = next(n for n in reversed(cluster.nodes) if not n.lost and n is not host)
        cluster.lose(host)
        cluster.start(host.rank)
        cluster.wait_for_step(PREEMPTED_AT)
        for node in cluster.nodes:
            if node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGTERM)  # the kubelet's SIGTERM to every pod's PID 1
        preempted_codes = cluster.run_to_end(timeout=60)
        for node in [n for n in cluster.nodes if not n.lost]:  # the cluster layer: every pod started again
            node.lost = True
            cluster.start(node.rank)
        codes = cluster.run_to_end(timeout=180)
        shm_left = cluster.left_in_memory()
        late = cluster.start(0)  # a pod started again after the job ended (its node lost in the run's last seconds)
        began = time.monotonic()
        late_code = late.proc.wait(timeout=120)
        yield {"cluster": cluster, "codes": codes, "stopped_at": stopped_at, "lost_at": lost_at, "host": host,
               "survivor": survivor, "preempted_codes": preempted_codes, "shm_left": shm_left,
               "late": (late, late_code, time.monotonic() - began)}


def _recovered(run, **match):
    run_dir = run["cluster"].run_dir
    found = [r for r in events(run_dir, "recovered") if all(r.get(k) == v for k, v in match.items())]
    assert found, f"no recovered record with {match} {WHY}: {events(run_dir, 'recovered')}"
    return found


def test_every_node_finishes_bit_identical_to_the_fault_free_run(layered, reference):
    assert set(layered["codes"].values()) == {0}, f"{layered['codes']} {WHY}\n{layered['cluster'].tail()}"
    assert_same_weights(layered["cluster"].run_dir, reference)
    assert not layered["shm_left"], f"left in /dev/shm: {sorted(layered['shm_left'])} {WHY}"


def test_exception_and_hang_are_recovered_in_process_across_nodes(layered):
    (exception,) = _recovered(layered, fault_kind="exception")
    (hang,) = _recovered(layered, fault_kind="hang")
    for r in (exception, hang):
        assert r["layer"] == "inprocess" and r["tiers"] == {"memory": [0, 1]}, f"{r} {WHY}"
        assert r["steps_redone"] <= REDONE_MAX, f"{r} {WHY}"
    assert hang["recovery_s"] < HARD_S + 10, f"a GIL-free hang is recovered before the hard timeout {hang} {WHY}"
    run_dir = layered["cluster"].run_dir
    (fault,) = [r for r in events(run_dir, "fault") if r["kind"] == "exception"]
    restarts = [r for r in events(run_dir, "restart") if r["layer"] == "inprocess"]
    assert sorted(r["rank"] for r in restarts) == [0, 0, 1, 1], f"one restart per fault and rank {restarts} {WHY}"
    (rank1,) = [r for r in restarts if r["rank"] == 1 and r["fault"]["kind"] == "exception"]
    assert rank1["pid"] == fault["pid"], "rank 1 restarts in the same process"
    assert {r["tier"] for r in restarts} == {"memory"}, "an in-process restart reads no checkpoint file"
    node1 = "".join(n.output() for n in layered["cluster"].nodes if n.rank == 1)
    assert "from the memory tier (in-process restart: no file read)" in node1
    phases = exception["phases"]  # fault -> abort -> Wrapper -> re-entry, from the moments the real Wrapper noted
    assert {"detect", "abort", "wrapper", "process_group", "restore", "first_step"} <= set(phases)
    before = sum(v for k, v in phases.items() if k in ("unwind", "detect", "abort", "wrapper", "reconnect"))
    assert abs(before + phases["total"] - exception["recovery_s"]) < 0.05, phases
    # Each rank logs its abort's parts and where the Wrapper's part went (bench/figures.py recovery reads them).
    assert re.search(r"\[rank1\] .*in-process abort: (nested restarter [\d.]+ s, )?torch.distributed [\d.]+ s", node1)
    wrapper = re.search(r"\[rank1\] .*from the abort's end to this call: ([\d.]+) s: health checks ([\d.]+) s, "
                        r"garbage collection ([\d.]+) s \((\d+) collections\), the rest", node1)
    # The total comes from the restart's marks, the parts from their own timers: the parts must fit inside it.
    assert wrapper and int(wrapper[4]) >= 1, node1[-3000:]
    assert float(wrapper[2]) + float(wrapper[3]) <= float(wrapper[1]) + 0.002, wrapper[0]


def test_a_killed_worker_restarts_every_node_in_job_from_node_memory(layered):
    (killed,) = _recovered(layered, fault_kind="sigkill")
    assert killed["layer"] == "injob" and killed["tiers"] == {"node-local": [0, 1]}, f"{killed} {WHY}"
    assert killed["steps_redone"] <= REDONE_MAX, f"{killed} {WHY}"


def test_a_hung_node_is_restarted_in_job_on_every_node(layered):
    run_dir = layered["cluster"].run_dir
    after = [r for r in events(run_dir, "recovered") if r["time"] > layered["stopped_at"]]
    assert after and after[0]["layer"] == "injob", f"{after} {WHY}"
    assert after[0]["fault_step"] is not None and after[0]["steps_redone"] <= REDONE_MAX, f"{after[0]} {WHY}"
    # the stopped rank's monitors end it: the in-process hard timeout (8 s) or the heartbeat, then a restart
    assert after[0]["time"] - layered["stopped_at"] < HANGS_BOUND_S, f"{after[0]} {WHY}"
    restarts = [r for r in events(run_dir, "restart") if r["time"] > layered["stopped_at"]][:2]
    assert {r["rank"] for r in restarts} == {0, 1} and {r["layer"] for r in restarts} == {"injob"}, restarts


HANGS_BOUND_S = 8 + 1 + 30  # hard timeout + grace, then a restart of both nodes on 2 loaded cores


def _assert_tiers(recovered, joined_rank):
    """The rank on the new node fetched its replica from the other node's memory (the peer tier), the other restored
    from its own node's memory, and no byte of ``checkpoint.dir`` was read."""
    tiers = recovered["tiers"]
    assert tiers == {"peer": [joined_rank], "node-local": [1 - joined_rank]}, f"{recovered} {WHY}"
    read = recovered["bytes_read"]
    assert read.get("peer", 0) > 0 and read.get("disk", 0) == 0, f"{recovered} {WHY}"


def test_a_lost_node_comes_back_on_a_replacement_pod_the_others_from_memory(layered):
    (lost,) = _recovered(layered, fault_kind="node_lost")
    assert lost["layer"] == "node", lost
    _assert_tiers(lost, 0)
    (restart,) = [r for r in events(layered["cluster"].run_dir, "restart") if r["rank"] == 0 and
                  r["fault"].get("kind") == "node_lost"]
    assert restart["joined"] == [0], restart


def test_losing_the_node_that_hosts_the_rendezvous_is_recovered_in_the_job(layered):
    after = [r for r in events(layered["cluster"].run_dir, "recovered") if r["time"] > layered["lost_at"]]
    assert after and after[0]["layer"] == "node", f"{after} {WHY}"
    host_rank = layered["host"].rank  # node rank = its ranks (FT_LOCAL_ADDR keeps the order)
    _assert_tiers(after[0], host_rank)
    # no fault injected: its step is the one the survivor's rank was stopped in (its exit record)
    assert after[0]["fault_step"] is not None and after[0]["steps_redone"] <= REDONE_MAX, f"{after[0]} {WHY}"
    assert "joins it again" in layered["survivor"].output(), "the survivor's launcher lost the store and joined again"


def test_preemption_of_every_pod_commits_and_every_pod_started_again_resumes(layered):
    assert set(layered["preempted_codes"].values()) == {ExitCode.PREEMPTED}, f"{layered['preempted_codes']} {WHY}"
    run_dir = layered["cluster"].run_dir
    (preempted,) = events(run_dir, "preempted")
    assert (run_dir / "checkpoints" / f"step-{preempted['step']:08d}" / "manifest.json").exists()
    (resumed,) = _recovered(layered, layer="cluster")
    assert resumed["fault_kind"] == "preemption" and resumed["steps_redone"] == 0, resumed
    assert resumed["step"] == preempted["step"] + 1 and resumed["tiers"] == {"disk": [0, 1]}, resumed
    relaunched = [r for r in events(run_dir, "restart") if r["layer"] == "cluster"]
    assert sorted(r["rank"] for r in relaunched) == [0, 1], relaunched
    assert {(r["resumed_step"], r["tier"]) for r in relaunched} == {(preempted["step"], "disk")}, relaunched


def test_a_node_started_after_the_run_finished_exits_0_without_waiting_for_the_others(layered):
    """The nodes that trained the run left when it ended: a pod started after that (a replacement for one lost in the
    run's last seconds) has nothing to wait for in the rendezvous (15 minutes, then a failed job)."""
    node, code, took = layered["late"]
    out = node.output()
    assert code == 0 and "the run already finished" in out and "training finished" in out, out[-3000:]
    assert "starting workers" not in out and took < 60, f"{took:.0f} s\n{out[-3000:]}"


def test_a_permanent_error_on_one_node_stops_every_node_with_its_code(tmp_path, tiny_dataset):
    with Cluster(tmp_path, tiny_dataset, 2, 1, [*ARGS, "--resiliency.faults=1:3:data_error"], env=ENV) as cluster:
        cluster.start_all()
        began = time.monotonic()
        codes = cluster.wait(timeout=90)
        took = time.monotonic() - began
    assert set(codes.values()) == {ExitCode.DATA_ERROR}, f"{codes}\n{cluster.tail()}"
    for node in cluster.nodes:
        out = node.output()
        assert "will restart worker group" not in out, f"{node.name} restarted its workers:\n{out[-3000:]}"
        assert "exiting 3: rank 1" in out, out[-3000:]
    assert took < 60, f"every node stopped {took:.0f} s after the start"
