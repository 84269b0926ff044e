"""Shared fixtures: a small token dataset built from the stdlib corpus, and a multi-process launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """~0.5M tokens from the first stdlib files; vocab 2048. Built once per test session."""
    from components.lib.tokendata import build_dataset, default_corpus

    out = tmp_path_factory.mktemp("data") / "stdlib"
    build_dataset(default_corpus(), out, vocab_size=2048, max_bytes=2_000_000, seed=0)
    return out


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
