"""Helpers shared by the test directories (import as ``from testlib import ...``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
RESTARTED = "will restart worker group"  # ft_launcher's line for an in-job restart
MICRO_MODEL = ("--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
               "--model.ffn_dim=176")
"""Overrides for a smaller model than the tiny preset (dim 64, 2 layers), for 2-rank runs whose checks (bit-identity,
a falling loss, resharding) do not depend on its size: a 30-step run takes 7 CPU-s instead of 13.5, and FSDP2 shards
the same kinds of parameters (21 tensors)."""


def fault_seed() -> int:
    """The seed a fault test draws its fault steps from: ``FAULT_SEED`` from the environment (to replay a failure,
    whose message names its seed), else a new one each run."""
    given = os.environ.get("FAULT_SEED")
    return int(given) if given else int.from_bytes(os.urandom(4), "little")


def free_port() -> int:
    """A port for a launcher's rendezvous, outside the ephemeral range as the launcher's own choice for its workers
    (``trainer.resiliency.launch.bound_socket``): no connection opened while it starts can be given it."""
    from trainer.resiliency.launch import free_port as outside_the_ephemeral_range

    return outside_the_ephemeral_range()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchrun(
    args: list[str], nproc: int = 2, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m trainer <args>`` on ``nproc`` CPU processes with torchrun; output captured."""
    cmd = [
        str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "trainer", *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def run_session(cmd: list[str], env: dict[str, str], timeout: float, timeout_message: str) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own, output (stdout and stderr) captured; (returncode, output). At
    ``timeout`` the whole process session is stopped (launcher, workers, their writers) and the test fails with
    ``timeout_message`` and the output's tail: first SIGABRT, on which every Python process of it prints each of its
    threads' stack (``PYTHONFAULTHANDLER``), so a hang in CI says where it hung; SIGKILL for what is left."""
    import signal

    import pytest

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**env, "PYTHONFAULTHANDLER": "1"}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out = ""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        out = (out or "") + (rest or "")
        pytest.fail(f"{timeout_message} (the stacks at SIGABRT are at the end):\n{out[-12000:]}")
    return proc.returncode, out


def torchrun_probe(script: Path, arg: Path, blocked_message: str, timeout: float = 100) -> str:
    """Run a 2-rank probe script under torchrun and return rank 0's ``rank0: ...`` line, then the output's tail;
    fails the test with ``blocked_message`` when the ranks are still blocked at ``timeout``. (The release probes:
    rank 1 leaves a group while rank 0 is blocked in it.)"""
    rc, out = run_session(
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script), str(arg)],
        {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'trainer_image'}{os.pathsep}{REPO}"},
        timeout, blocked_message)
    assert rc == 0, out[-3000:]
    return next((line for line in out.splitlines() if line.startswith("rank0:")), "") + "\n" + out[-3000:]


def write_token_shards(root: Path, shard_lengths: list[int], vocab_size: int = 65536) -> Path:
    """A dataset per SHARDS.md whose token ids are all distinct (id = global position), for exact checks."""
    root.mkdir(parents=True)
    (root / "tokenizer.json").write_bytes(b"{}")
    entries, base = [], 0
    for i, n in enumerate(shard_lengths):
        raw = (base + np.arange(n)).astype("<u2").tobytes()
        (root / f"train-{i:05d}.bin").write_bytes(raw)
        entries.append({"file": f"train-{i:05d}.bin", "num_tokens": n, "num_bytes": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest()})
        base += n
    manifest = {
        "format": "resilient-train.token-shards",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": vocab_size,
        "eos_id": 0,
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": hashlib.sha256(b"{}").hexdigest(),
        "splits": {"train": entries},
        "num_tokens": {"train": base},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root
