"""The local backend's restart budget, progress lines and process cleanup, with fake entrypoints."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from pipeline_fakes import write_script

from components.lib import local_launcher as ll
from components.lib.local_launcher import (
    DeadlineExceeded, LocalJobSpec, LocalLauncher, PermanentFailure, RestartBudgetExceeded, kill_leftovers,
)


def counting_entrypoint(tmp_path, codes):
    """Exits with codes[n] on its n-th launch (the last code repeats); records argv and env per launch."""
    return write_script(tmp_path / "entrypoint.sh", f"""
        import json, os, sys
        from pathlib import Path
        log = Path({str(tmp_path / 'launches.jsonl')!r})
        n = len(log.read_text().splitlines()) if log.exists() else 0
        keys = ("NPROC_PER_NODE", "FT_MAX_RESTARTS", "PATH", "MASTER_PORT", {ll.MARKER_ENV!r})
        with log.open("a") as f:
            f.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}}}}) + "\\n")
        print(f"step {{10 * (n + 1):>6}} loss 5.2100 lr 1.00e-03 1,234 tok/s 10 ms", flush=True)
        print("launch", n, "exiting", {codes!r}[min(n, {len(codes) - 1})], flush=True)
        sys.exit({codes!r}[min(n, {len(codes) - 1})])
    """)


def launches(tmp_path):
    return [json.loads(line) for line in (tmp_path / "launches.jsonl").read_text().splitlines()]


def spec(tmp_path, entry, **kw):
    return LocalJobSpec(args=["--config", "tiny", "--train.steps=40"], entrypoint=entry, state_dir=tmp_path / "state",
                        relaunch_delay_s=0, total_steps=40, **kw)


def test_success_streams_progress_and_passes_the_contract_env(tmp_path):
    out = io.StringIO()
    result = LocalLauncher(out).run(spec(tmp_path, counting_entrypoint(tmp_path, [0]), nproc_per_node=3,
                                         ft_max_restarts=5))
    assert result.relaunches == 0 and result.launches[0].exit_code == 0
    (launch,) = launches(tmp_path)
    assert launch["argv"] == ["--config", "tiny", "--train.steps=40"]
    assert launch["env"]["NPROC_PER_NODE"] == "3" and launch["env"]["FT_MAX_RESTARTS"] == "5"
    assert launch["env"]["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert "[train] step 10/40 loss 5.2100 (25%) 1,234 tok/s" in out.getvalue()
    assert not (tmp_path / "state" / ll.STATE_FILE).exists()
    assert (tmp_path / "state" / "launch-1.log").read_text().startswith("step")


def test_retryable_exit_relaunches_within_budget(tmp_path):
    out = io.StringIO()
    result = LocalLauncher(out).run(spec(tmp_path, counting_entrypoint(tmp_path, [202, 137, 0]),
                                         max_cluster_restarts=2))
    assert [x.exit_code for x in result.launches] == [202, 137, 0]
    assert result.relaunches == 2
    assert "exit 202 (PREEMPTED) is retryable: relaunching (1/2)" in out.getvalue()
    assert "(resumed)" not in out.getvalue()  # steps grew: 10, 20, 30


def test_permanent_exit_fails_at_once_with_the_log_tail(tmp_path):
    with pytest.raises(PermanentFailure) as info:
        LocalLauncher(io.StringIO()).run(spec(tmp_path, counting_entrypoint(tmp_path, [3, 0]),
                                              max_cluster_restarts=5))
    assert len(launches(tmp_path)) == 1
    assert info.value.exit_code == 3
    assert "3 (DATA_ERROR)" in str(info.value) and "launch 0 exiting 3" in str(info.value)


def test_budget_exhausted_fails_with_a_clear_message(tmp_path):
    with pytest.raises(RestartBudgetExceeded) as info:
        LocalLauncher(io.StringIO()).run(spec(tmp_path, counting_entrypoint(tmp_path, [200]),
                                              max_cluster_restarts=1))
    assert len(launches(tmp_path)) == 2
    msg = str(info.value)
    assert "200 (RESTART_BUDGET_EXHAUSTED)" in msg and "max_cluster_restarts=1" in msg
    assert "pipeline step's retry resumes from the latest checkpoint" in msg


def test_zero_budget_fails_on_the_first_retryable_exit(tmp_path):
    with pytest.raises(RestartBudgetExceeded):
        LocalLauncher(io.StringIO()).run(spec(tmp_path, counting_entrypoint(tmp_path, [202, 0])))
    assert len(launches(tmp_path)) == 1


def test_death_by_signal_counts_as_retryable(tmp_path):
    entry = write_script(tmp_path / "entrypoint.sh", """
        import os, signal
        from pathlib import Path
        flag = Path(__file__).with_name("killed-once")
        if not flag.exists():
            flag.touch()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = LocalLauncher(io.StringIO()).run(spec(tmp_path, entry, max_cluster_restarts=1))
    assert [x.exit_code for x in result.launches] == [137, 0]


def test_deadline_kills_the_whole_tree(tmp_path):
    pidfile = tmp_path / "child.pid"
    entry = write_script(tmp_path / "entrypoint.sh", f"""
        import subprocess, sys, time
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)  # escapes the process group
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(300)
    """)
    with pytest.raises(DeadlineExceeded):
        LocalLauncher(io.StringIO()).run(spec(tmp_path, entry, deadline_s=1.5))
    child = int(pidfile.read_text())
    time.sleep(0.2)
    assert not ll._alive(child), "a grandchild in its own session survived the launcher"


def test_kill_leftovers_is_idempotent(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    # Unique: kill_leftovers kills every process carrying the marker, machine-wide, so a fixed one let another
    # checkout's run of this test kill this test's process first (seen once: 0 signalled instead of 1).
    marker = f"test-marker-{uuid.uuid4().hex}"
    proc = subprocess.Popen(["sleep", "300"], env={**os.environ, ll.MARKER_ENV: marker}, start_new_session=True)
    ll._write_state(state, proc.pid, marker)
    # a leftover is a process that has run its program: until the child's exec, /proc shows the parent's
    # environment, without the marker (seen under load in CI: 0 signalled instead of 1)
    deadline = time.monotonic() + 10
    while ll._marked_pids(marker) != [proc.pid]:
        assert time.monotonic() < deadline, "the child never carried the marker"
        time.sleep(0.01)
    assert kill_leftovers(state, grace_s=2) == 1
    assert proc.wait(timeout=5) == -signal.SIGTERM
    assert kill_leftovers(state) == 0  # nothing left, no state file: a no-op
    assert not (state / ll.STATE_FILE).exists()


def test_missing_entrypoint_is_a_permanent_failure(tmp_path):
    with pytest.raises(PermanentFailure, match="missing or not executable"):
        LocalLauncher(io.StringIO()).run(spec(tmp_path, tmp_path / "nope.sh"))


def test_exit_code_mirror_matches_the_trainer_contract():
    from trainer.exitcodes import ExitCode, is_retryable

    assert ll.EXIT_NAMES == {int(c): c.name for c in ExitCode}
    assert all(ll.is_retryable(c) == is_retryable(c) for c in range(256))


def test_peer_tier_names_mirror_the_trainers():
    from components.lib import jobsecret
    from trainer.checkpoint import peerauth, replicas

    assert (jobsecret.SECRET_FILE_ENV, jobsecret.REPLICA_ADDR_ENV) == (peerauth.SECRET_FILE_ENV, replicas.ADDR_ENV)
    assert len(jobsecret.new_secret()) >= peerauth.MIN_SECRET_BYTES


def test_default_entrypoint_is_the_projects():
    assert ll.default_entrypoint().is_file() and os.access(ll.default_entrypoint(), os.X_OK)


def test_args_must_be_a_list():
    with pytest.raises(ValueError, match="not one string"):
        LocalJobSpec(args="--config tiny")


# --- several nodes: one entrypoint each, as the pods ------------------------------------------------------------
def node_entrypoint(tmp_path, plan):
    """Node k's n-th start (incarnation) follows ``plan[k][n]`` (the last repeats): ``("exit", code)`` after 0.3 s, or
    ``("wait", name)``: run until the file ``name`` exists, then exit 0. Records each start's node, env and argv."""
    return write_script(tmp_path / "entrypoint.sh", f"""
        import json, os, sys, time
        from pathlib import Path
        node = int(os.environ["PET_NODE_RANK"])
        log = Path({str(tmp_path / 'starts.jsonl')!r})
        n = sum(json.loads(line)["node"] == node for line in log.read_text().splitlines()) if log.exists() else 0
        keys = ("PET_NNODES", "PET_NODE_RANK", "FT_LOCAL_ADDR", "MASTER_ADDR", "MASTER_PORT", "TRAINER_NODES",
                "TRAINER_MIN_NODES", "TRAINER_REPLICA_ADDR", "TRAINER_JOB_SECRET_FILE")
        secret = Path(os.environ["TRAINER_JOB_SECRET_FILE"])
        with log.open("a") as f:
            f.write(json.dumps({{"node": node, "n": n, "argv": sys.argv[1:],
                                 "env": {{k: os.environ.get(k) for k in keys}},
                                 "secret": [oct(secret.stat().st_mode & 0o777), len(secret.read_text())]}}) + "\\n")
        steps = {plan!r}[node]
        what, arg = steps[min(n, len(steps) - 1)]
        print(f"node {{node}} start {{n}}: {{what}} {{arg}}", flush=True)
        if what == "exit":
            time.sleep(0.3)
            sys.exit(arg)
        while not Path({str(tmp_path)!r}, arg).exists():
            time.sleep(0.05)
    """)


def starts(tmp_path):
    return [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]


def test_every_node_gets_its_rank_address_and_memory(tmp_path):
    (tmp_path / "go").touch()
    entry = node_entrypoint(tmp_path, [[("wait", "go")], [("wait", "go")]])
    result = LocalLauncher(io.StringIO()).run(spec(tmp_path, entry, nodes=2, nproc_per_node=1))
    assert result.relaunches == 0
    by_node = {s["node"]: s for s in starts(tmp_path)}
    assert {k: (s["env"]["PET_NNODES"], s["env"]["FT_LOCAL_ADDR"]) for k, s in by_node.items()} == {
        0: ("2", "127.0.0.1"), 1: ("2", "127.0.0.2")}
    # the node's replica servers listen on its own address; every node signs its peer tier with the launch's secret:
    # one 0600 file, gone with the launch
    assert [by_node[k]["env"]["TRAINER_REPLICA_ADDR"] for k in (0, 1)] == ["127.0.0.1", "127.0.0.2"]
    secrets = {s["env"]["TRAINER_JOB_SECRET_FILE"] for s in by_node.values()}
    assert len(secrets) == 1 and [s["secret"] for s in by_node.values()] == [["0o600", 64]] * 2
    assert not Path(secrets.pop()).exists()
    assert by_node[0]["env"]["MASTER_PORT"] == by_node[1]["env"]["MASTER_PORT"]
    memory = {k: s["argv"][-1] for k, s in by_node.items()}
    assert all(m.startswith("--checkpoint.node_local_dir=") for m in memory.values()) and memory[0] != memory[1]
    log = (tmp_path / "state" / "launch-1.log").read_text()
    assert "[node 0] node 0 start 0" in log and "[node 1] node 1 start 0" in log


def test_a_node_lost_while_the_other_runs_is_started_again(tmp_path):
    entry = node_entrypoint(tmp_path, [[("wait", "done")], [("exit", 137), ("exit", 0)]])
    out = io.StringIO()
    with_done = threading.Timer(3.0, lambda: (tmp_path / "done").touch())
    with_done.start()
    result = LocalLauncher(out).run(spec(tmp_path, entry, nodes=2, nproc_per_node=1, max_cluster_restarts=1))
    with_done.cancel()
    assert result.relaunches == 1 and result.launches[0].node_restarts == 1 and len(result.launches) == 1
    assert "node 1 exited 137 (KILLED) while the others run: starting it again" in out.getvalue()
    node1 = [s for s in starts(tmp_path) if s["node"] == 1]
    assert len(node1) == 2 and node1[0]["argv"][-1] != node1[1]["argv"][-1], "a new pod: new, empty memory"


def test_spare_nodes_wait_in_the_rendezvous_and_the_last_one_used_is_said(tmp_path):
    """2 nodes and a spare: three entrypoints for a rendezvous of two (PET_NNODES counts the pods, TRAINER_NODES the
    rendezvous); a node lost while the others run uses the spare, and its replacement waits as the next spare."""
    entry = node_entrypoint(tmp_path, [[("wait", "done")], [("exit", 137), ("wait", "done")], [("wait", "done")]])
    out = io.StringIO()
    with_done = threading.Timer(3.0, lambda: (tmp_path / "done").touch())
    with_done.start()
    result = LocalLauncher(out).run(spec(tmp_path, entry, nodes=2, spare_nodes=1, nproc_per_node=1,
                                         max_cluster_restarts=1))
    with_done.cancel()
    firsts = [s for s in starts(tmp_path) if s["n"] == 0]
    assert sorted(s["node"] for s in firsts) == [0, 1, 2]
    assert {(s["env"]["PET_NNODES"], s["env"]["TRAINER_NODES"]) for s in firsts} == {("3", "2")}
    assert "node 1 exited 137 (KILLED): a spare node takes its place (that was the last spare node" in out.getvalue()
    assert result.launches[0].node_restarts == 1, "the lost node's replacement waits as a spare"


def test_min_nodes_gives_each_node_the_elastic_range(tmp_path):
    """min_nodes < nodes: each entrypoint gets TRAINER_NODES (the range's max) and TRAINER_MIN_NODES; a node lost
    while the others run is started again (the job grows back when it joins); min_nodes out of range is refused."""
    entry = node_entrypoint(tmp_path, [[("wait", "done")], [("exit", 137), ("wait", "done")]])
    with_done = threading.Timer(3.0, lambda: (tmp_path / "done").touch())
    with_done.start()
    result = LocalLauncher(io.StringIO()).run(spec(tmp_path, entry, nodes=2, min_nodes=1, nproc_per_node=1,
                                                   max_cluster_restarts=1))
    with_done.cancel()
    envs = {(s["env"]["PET_NNODES"], s["env"]["TRAINER_NODES"], s["env"]["TRAINER_MIN_NODES"])
            for s in starts(tmp_path)}
    assert envs == {("2", "2", "1")} and result.launches[0].node_restarts == 1
    with pytest.raises(ValueError, match=r"min_nodes must be from 0 \(not elastic\) to nodes \(2\); got 3"):
        spec(tmp_path, entry, nodes=2, min_nodes=3)


def test_a_node_lost_with_no_restart_left_stops_the_job(tmp_path):
    entry = node_entrypoint(tmp_path, [[("wait", "never")], [("exit", 137)]])
    with pytest.raises(RestartBudgetExceeded) as info:
        LocalLauncher(io.StringIO()).run(spec(tmp_path, entry, nodes=2, nproc_per_node=1, max_cluster_restarts=0))
    assert info.value.exit_code == 137
    assert len(starts(tmp_path)) == 2, "nothing started again"


def test_a_permanent_exit_on_one_node_fails_the_job_with_its_code(tmp_path):
    entry = node_entrypoint(tmp_path, [[("wait", "never")], [("exit", 3)]])
    ll_grace, ll.NODE_ENDED_GRACE_S = ll.NODE_ENDED_GRACE_S, 1.0  # node 0 does not stop by itself here
    try:
        with pytest.raises(PermanentFailure) as info:
            LocalLauncher(io.StringIO()).run(spec(tmp_path, entry, nodes=2, nproc_per_node=1,
                                                  max_cluster_restarts=3))
    finally:
        ll.NODE_ENDED_GRACE_S = ll_grace
    assert info.value.exit_code == 3 and len(starts(tmp_path)) == 2
