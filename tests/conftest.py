"""Shared fixtures; plain helpers live in ``testlib.py`` (one module name for every test directory)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """~0.5M tokens from the first stdlib files; vocab 2048. Built once per test session."""
    from components.lib.tokendata import build_dataset, default_corpus

    out = tmp_path_factory.mktemp("data") / "stdlib"
    build_dataset(default_corpus(), out, vocab_size=2048, max_bytes=2_000_000, seed=0)
    return out
