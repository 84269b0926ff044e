"""The peer tier across nodes: three ``entrypoint.sh`` nodes of one worker and a fourth launcher waiting as a spare
(``nodeharness``), the tiny model on gloo, a snapshot every 2 steps replicated to the next node's memory.

One run takes three node losses in turn, so the suite pays for one start:
1. a node lost, the spare takes its place: its rank fetches its replica from the node holding it, the others restore
   from their own node memory, and no byte of ``checkpoint.dir`` is read (the ledger's ``bytes_read``);
2. once the persistent tier holds a step, an outsider (``peerlib``: the job key, no secret or another job's) at
   every node's replica server gets nothing and writes nothing; then a node lost and the replicas its holder keeps
   of it corrupted (flipped bytes) before the replacement pod starts: the replica is refused (its source's seal)
   and that rank reads the next tier, the disk (with no step on disk every rank would start over from a fresh
   state: ``test_tiers``);
3. a node and the node holding its replicas lost together: the first's rank reads the persistent tier (one line
   says why), the second's fetches its replica from the third node.
The run ends bit-identical to a fault-free run of the same three ranks. Each loss's step is drawn anew each run (0
or 1 step after a snapshot); the seed is in every failure's message. (Two nodes, one lost and replaced, restoring
from the peer tier: ``test_nodes``.)
"""

from __future__ import annotations

import hashlib
import random
import re
import time

import pytest
import torch

from nodeharness import Cluster
from peerlib import ATTACK_SLOT, assert_nothing_got, attack
from test_nodes import ENV
from test_recovery import GRACE, TINY_BASE, VENV_BIN, _run, events, node_dir
from testlib import fault_seed
from trainer.checkpoint import committed_steps, load_model_weights

pytestmark = [pytest.mark.multiprocess, pytest.mark.serial, pytest.mark.timeout(900)]  # four launchers on 2 cores

STEPS = 30
SEED = fault_seed()
DRAW = random.Random(SEED)
SPARE_AT, CORRUPT_AT, BOTH_AT = DRAW.randint(7, 8), DRAW.randint(14, 15), DRAW.randint(21, 22)
WHY = f"(seed {SEED}: nodes lost at steps {SPARE_AT}, {CORRUPT_AT} (replicas corrupted), {BOTH_AT} (with its holder))"
# No in-process layer: a lost node is the in-job layer's (every node's launcher meets the new one); one thread per
# worker, as in test_nodes. The tiny model, not the micro one: the losses' timing (where each lands against the
# replicas' pushes) is set for its steps.
RUN_ARGS = [*(a for a in TINY_BASE if not a.startswith("--train.steps")), f"--train.steps={STEPS}",
            "--train.cpu_threads=1",
            *GRACE, "--checkpoint.memory_slots=3"]  # the peer tier: checkpoint.replicas=auto (1 from two nodes on)
# Three slots: every snapshot is persisted and a write of the tiny state takes seconds on 2 loaded cores, so one slot
# is nearly always held by the writer; with two, a loss while the newest snapshot was still being pushed finds the
# lost rank's replicas at {written, torn} and the survivors' slots at {written, newest}: only the written step (6
# steps back, seen) is common. The third keeps the snapshot before the newest on every rank and its holder.


@pytest.fixture(scope="module")
def reference3(tmp_path_factory, tiny_dataset):
    """The fault-free run: three ranks under torchrun on one node."""
    run_dir = tmp_path_factory.mktemp("reference3")
    cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node=3", "--master-port={port}", "-m", "trainer", *RUN_ARGS,
           f"--data.path={tiny_dataset}", f"--train.run_dir={run_dir}",
           f"--checkpoint.node_local_dir={node_dir(run_dir)}"]
    rc, out, _ = _run(cmd, run_dir)
    assert rc == 0, out[-4000:]
    return load_model_weights(run_dir / "checkpoints")


def _mtime(path):
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # restaged meanwhile
        return 0.0


def _node_of_rank(cluster, rank):
    """The live node running ``rank`` (one worker per node): the rank of its newest slot file (a node keeps the files
    of a rank it ran before a new rendezvous numbered it otherwise)."""
    for node in cluster.nodes:
        files = sorted(node.memory.glob("*/rank-*.slot-*.data"), key=_mtime)
        if not node.lost and node.proc.poll() is None and files and files[-1].name.startswith(f"rank-{rank:05d}."):
            return node
    raise AssertionError(f"no live node runs rank {rank} {WHY}\n{cluster.tail()}")


def _flip(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _wait_for_a_committed_step(cluster, timeout=120):
    """The persistent tier lags the snapshots by a write or more on 2 loaded cores; the corrupted replica's rank
    must find a step there."""
    deadline = time.monotonic() + timeout
    while not committed_steps(cluster.run_dir / "checkpoints"):
        assert time.monotonic() < deadline, f"no checkpoint committed in {timeout} s {WHY}\n{cluster.tail()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def peers(tmp_path_factory, tiny_dataset):
    base = tmp_path_factory.mktemp("peers")
    marks = {}
    with Cluster(base, tiny_dataset, 3, 1, RUN_ARGS, env=ENV) as cluster:
        cluster.start_all()
        cluster.start(3)  # the spare: a fourth launcher for a job of three nodes waits in the rendezvous
        cluster.wait_for_step(SPARE_AT, timeout=300)  # four launchers starting at once on 2 cores
        marks["spare"] = time.time()
        cluster.lose(_node_of_rank(cluster, 1))
        cluster.wait_for_step(CORRUPT_AT, timeout=240)
        _wait_for_a_committed_step(cluster)
        marks["attacked"], marks["left"] = _attack(cluster)
        lost = _node_of_rank(cluster, 2)
        cluster.lose(lost)
        marks["corrupt"] = time.time()
        corrupted = [p for n in cluster.nodes if not n.lost for p in n.memory.glob("*/peer-rank-00002.slot-*.data")]
        for path in corrupted:
            _flip(path)
        cluster.start(lost.rank)
        cluster.wait_for_step(BOTH_AT, timeout=240)
        first, holder = _node_of_rank(cluster, 0), _node_of_rank(cluster, 1)
        marks["both"] = time.time()
        cluster.lose(first)
        cluster.lose(holder)
        cluster.start(first.rank)
        cluster.start(holder.rank)
        codes = cluster.run_to_end(timeout=240)
        yield {"cluster": cluster, "codes": codes, "marks": marks, "corrupted": corrupted}


def _attack(cluster):
    """The outsider of issue 54 (``peerlib``), at every live node's replica server while the job trains: the job key
    from the rendezvous id and the checkpoint path (checked against a replica's header), no secret or another job's.
    Returns what each server gave, and the files of the outsider's slot left in the nodes' memory."""
    key = hashlib.sha256(f"resilient-train\0{(cluster.run_dir / 'checkpoints').resolve()}".encode()).hexdigest()
    header = next(p for n in cluster.nodes if not n.lost for p in n.memory.glob("*/peer-rank-*.slot-*.meta"))
    assert torch.load(header, weights_only=True)["job"] == key, f"the outsider's job key is not the job's {WHY}"
    servers = {}
    for node in cluster.nodes:
        if not node.lost and node.proc.poll() is None:
            host, port = re.findall(r"replicas served at ([\d.]+):(\d+)", node.output())[-1]
            servers[node.name] = (host, int(port))
    got = {name: attack(address, key, source="127.0.0.99") for name, address in servers.items()}
    left = [p for n in cluster.nodes if not n.lost for p in n.memory.glob(f"*/*.slot-{ATTACK_SLOT}.*")]
    return {"servers": servers, "got": got}, left


def test_an_outsider_gets_nothing_from_the_running_job_and_writes_nothing(peers):
    """Without the job's secret, or with another job's: a fetch of rank 0's snapshots, a put, a put of 1 TiB, at each
    node's replica server, which listens on its node's own address only; each refused with one line naming it."""
    attacked = peers["marks"]["attacked"]
    assert len(attacked["servers"]) == 3 and all(  # node k's own address: 127.0.0.<k + 1> (nodeharness)
        host == f"127.0.0.{int(name[4:].split('.')[0]) + 1}" for name, (host, _) in attacked["servers"].items()), \
        f"{attacked['servers']} {WHY}"
    for got in attacked["got"].values():
        assert_nothing_got(got)
    assert peers["marks"]["left"] == [], WHY
    out = "".join(n.output() for n in peers["cluster"].nodes)
    refused = re.findall(r"peer tier: refused a request from 127\.0\.0\.99:\d+: (.*); nothing served", out)
    assert len(refused) == sum(len(got) for got in attacked["got"].values()), f"{len(refused)} {WHY}"


def _recovered_after(run, mark):
    run_dir = run["cluster"].run_dir
    after = [r for r in events(run_dir, "recovered") if r["time"] > run["marks"][mark]]
    assert after, f"no recovery after the {mark} loss {WHY}: {events(run_dir, 'recovered')}"
    return after[0]


def test_the_run_ends_bit_identical_to_the_fault_free_run(peers, reference3):
    assert set(peers["codes"].values()) == {0}, f"{peers['codes']} {WHY}\n{peers['cluster'].tail()}"
    weights = load_model_weights(peers["cluster"].run_dir / "checkpoints")
    for key in reference3:
        assert torch.equal(weights[key], reference3[key]), f"{key} differs from the fault-free run {WHY}"


def test_a_spare_takes_a_lost_nodes_place_restoring_from_the_peer_tier_without_reading_the_disk(peers):
    r = _recovered_after(peers, "spare")
    # which ranks read a peer's copy depends on the new rendezvous's numbering: a survivor given another number
    # fetches its old slots from itself as a peer; no rank reads the disk
    assert r["layer"] == "node" and r["tiers"].get("peer") and "disk" not in r["tiers"], f"{r} {WHY}"
    assert r["bytes_read"].get("peer", 0) > 0 and r["bytes_read"].get("disk", 0) == 0, f"{r} {WHY}"
    marks = peers["marks"]  # this loss's restarts only: the next loss may resume from the disk, steps before
    resumed = [x["resumed_step"] for x in events(peers["cluster"].run_dir, "restart")
               if marks["spare"] < x["time"] < marks["corrupt"]]
    assert resumed and min(resumed) >= SPARE_AT - 2 - 2, f"{resumed} {WHY}"  # an interval, and the step in flight


def test_a_corrupted_replica_is_refused_and_the_next_tier_used(peers):
    """Every replica of rank 2 corrupted: each is refused by its checksum and rank 2 reads the disk (the others their
    memory where it holds the step the disk has, else the disk too: the newest step every rank can reach)."""
    assert peers["corrupted"], f"no replica of rank 2 found on a live node {WHY}"
    r = _recovered_after(peers, "corrupt")
    assert r["tiers"].get("disk"), f"{r} {WHY}"
    assert r["bytes_read"].get("peer", 0) > 0 and r["bytes_read"].get("disk", 0) > 0, f"{r} {WHY}"
    out = "".join(n.output() for n in peers["cluster"].nodes)
    assert re.search(r"the peer tier's replica of step \d+ is unusable \(the replica from rank \d+ does not match "
                     r"its seal: altered on disk", out), WHY


def test_a_node_lost_with_its_replica_holder_reads_the_persistent_tier(peers):
    """Ranks 0 and 1 lost together: rank 1 held rank 0's replicas, so rank 0's state comes from the disk, and its rank
    says why in one line. (The new rendezvous may number the nodes otherwise, so which rank reads which tier is not
    fixed: the survivor serves its own slots and the replicas it held to whichever ranks now need them.)"""
    r = _recovered_after(peers, "both")
    assert r["tiers"].get("disk") and r["bytes_read"].get("disk", 0) > 0, f"{r} {WHY}"
    out = "".join(n.output() for n in peers["cluster"].nodes)
    # the cause it names: every holder lost, or (a node that ran this rank number before holds stale replicas of
    # it: the spare ran rank 1, holding rank 0's) replicas of older steps only
    assert "no snapshot of step" in out and "no replica of it on a live node (" in out, WHY
