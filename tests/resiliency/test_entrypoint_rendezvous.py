"""``entrypoint.sh``'s part in a job of several nodes, with a stand-in for the launcher (``FT_LAUNCHER``): it joins the
rendezvous again after losing it (``RENDEZVOUS_LOST``), for ``FT_RDZV_REJOIN_TIMEOUT`` at most; it names the store's
host explicitly where ``MASTER_ADDR`` is a name; and a rank of another node that ended the job ends this node with the
same code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from testlib import REPO
from trainer.exitcodes import ExitCode

ENTRYPOINT = REPO / "trainer_image" / "entrypoint.sh"


def stand_in(tmp_path: Path, plan: str) -> Path:
    """A launcher that records its arguments, then follows ``plan`` (Python run with ``n``, its start count)."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys, time
        from pathlib import Path
        log = Path({str(tmp_path / 'starts.jsonl')!r})
        n = len(log.read_text().splitlines()) if log.exists() else 0
        with log.open("a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
    """) + textwrap.dedent(plan))
    return script


def run(tmp_path: Path, plan: str, timeout: float = 60, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    launcher = f"{sys.executable} {stand_in(tmp_path, plan)}"
    result = subprocess.run([str(ENTRYPOINT), "--config", "tiny", f"--checkpoint.node_local_dir={tmp_path / 'shm'}"],
                            capture_output=True, text=True, timeout=timeout, cwd=REPO,
                            env={**os.environ, "FT_LAUNCHER": launcher, "TRAINER_STANDBY": "0", "TMPDIR": str(tmp_path),
                                 **env})
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    return result, starts


def test_a_lost_rendezvous_is_joined_again_and_the_node_finishes(tmp_path):
    result, starts = run(tmp_path, f"sys.exit({int(ExitCode.RENDEZVOUS_LOST)} if n < 2 else 0)")
    assert result.returncode == 0, result.stderr
    assert len(starts) == 3
    assert result.stderr.count("lost the job's rendezvous") == 2, result.stderr


def test_a_rendezvous_not_found_again_in_time_ends_the_pod_retryable(tmp_path):
    result, starts = run(tmp_path, f"sys.exit({int(ExitCode.RENDEZVOUS_LOST)})", FT_RDZV_REJOIN_TIMEOUT="2")
    assert result.returncode == ExitCode.RENDEZVOUS_LOST, result.stderr
    assert 2 <= len(starts) <= 4 and "was not found again in 2 s" in result.stderr


def test_the_store_host_is_named_where_master_addr_is_a_name(tmp_path):
    host = socket.gethostname()
    for addr, expected in ((f"{host}.svc.example", "last_call_timeout=30,is_host=true"),
                           ("other-pod-0", "last_call_timeout=30,is_host=false"),
                           ("127.0.0.1", "last_call_timeout=30"), ("localhost", "last_call_timeout=30")):
        (tmp_path / "starts.jsonl").unlink(missing_ok=True)
        result, starts = run(tmp_path, "sys.exit(0)", MASTER_ADDR=addr)
        assert result.returncode == 0, result.stderr
        conf = starts[0][starts[0].index("--rdzv-conf") + 1] if "--rdzv-conf" in starts[0] else None
        assert conf == expected, (addr, starts[0])


def test_the_node_wait_is_the_rendezvous_last_call(tmp_path):
    """TRAINER_NODE_WAIT_S (PET_NNODES=MIN:MAX): how long the others wait for a lost node before going on."""
    result, starts = run(tmp_path, "sys.exit(0)", TRAINER_NODE_WAIT_S="7", PET_NNODES="1:2")
    assert result.returncode == 0, result.stderr
    assert starts[0][starts[0].index("--rdzv-conf") + 1] == "last_call_timeout=7"
    bad, _ = run(tmp_path, "sys.exit(0)", TRAINER_NODE_WAIT_S="soon")
    assert bad.returncode == 2 and "TRAINER_NODE_WAIT_S must be a non-negative integer; got 'soon'" in bad.stderr


def test_the_node_range_comes_from_the_operator_or_trainer_nodes_and_reaches_the_workers(tmp_path):
    """The launcher's --nnodes: PET_NNODES=MIN:MAX (a PyTorchJob's elasticPolicy), or TRAINER_NODES (spare pods beyond
    it) with TRAINER_MIN_NODES; the workers see the range as TRAINER_NODE_RANGE. A range that cannot be: exit 2."""
    plan = f"open({str(tmp_path / 'range')!r}, 'a').write(os.environ['TRAINER_NODE_RANGE'] + '\\n'); sys.exit(0)"
    cases = [({"PET_NNODES": "2"}, "2", "2:2"), ({"PET_NNODES": "1:2"}, "1:2", "1:2"),
             ({"PET_NNODES": "3", "TRAINER_NODES": "2"}, "2", "2:2"),
             ({"PET_NNODES": "4", "TRAINER_NODES": "3", "TRAINER_MIN_NODES": "1"}, "1:3", "1:3"),
             ({"PET_NNODES": "2:4", "TRAINER_NODES": "4", "TRAINER_MIN_NODES": "2"}, "2:4", "2:4")]
    for env, nnodes, seen in cases:
        (tmp_path / "starts.jsonl").unlink(missing_ok=True)
        result, starts = run(tmp_path, plan, **env)
        assert result.returncode == 0, (env, result.stderr)
        assert starts[0][starts[0].index("--nnodes") + 1] == nnodes, (env, starts[0])
        assert (tmp_path / "range").read_text().splitlines()[-1] == seen, env
    for env, says in (({"PET_NNODES": "3:2"}, "TRAINER_MIN_NODES (or PET_NNODES's MIN) must be a number of nodes "
                       "from 1 to 2"), ({"PET_NNODES": "2", "TRAINER_MIN_NODES": "0"}, "got '0'"),
                      ({"PET_NNODES": "2", "TRAINER_NODES": "3"}, "TRAINER_NODES must be a number of nodes from 1 to "
                       "PET_NNODES (2); got '3'"), ({"PET_NNODES": "0"}, "PET_NNODES must be N or MIN:MAX")):
        (tmp_path / "starts.jsonl").write_text("")
        bad, starts = run(tmp_path, plan, **env)
        assert bad.returncode == 2 and says in bad.stderr and not starts, (env, bad.stderr)


def test_another_nodes_permanent_exit_ends_this_node_with_its_code(tmp_path):
    plan = """
        exit_dir = Path(os.environ["TRAINER_EXIT_CODE_DIR"])
        (exit_dir / "ended-rank-3").write_text("3\\n")  # as trainer.resiliency.launch hands it over
        os.kill(int(os.environ["TRAINER_ENTRYPOINT_PID"]), signal.SIGUSR1)
        time.sleep(30)  # stopped by the entrypoint's SIGTERM
    """
    result, _ = run(tmp_path, plan)
    assert result.returncode == ExitCode.DATA_ERROR, result.stderr
    assert "rank 3, on another node, exited 3; this node stops too" in result.stderr
