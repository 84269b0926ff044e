"""Helpers shared by the test directories (import as ``from testlib import ...``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
