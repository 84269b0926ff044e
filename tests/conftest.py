"""Shared fixtures; plain helpers live in ``testlib.py`` (one module name for every test directory)."""

from __future__ import annotations

from pathlib import Path

import pytest


# `make test` runs the multiprocess tests on two xdist workers a module at a time (--dist loadscope, in this
# order: --no-loadscope-reorder), so the longest modules go first and none is left to run alone at the end.
LONGEST_FIRST = (
    "tests/resiliency/test_recovery.py", "tests/hf/test_hf_training.py", "tests/pipelines/test_local_pipeline.py",
    "tests/pipelines/test_notebook.py", "tests/trainer/test_fsdp_training.py", "tests/resiliency/test_exit_contract.py",
    "tests/resiliency/test_node_memory.py", "tests/checkpoint/test_resume.py", "tests/resiliency/test_recovery_exits.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST)))  # stable: else as found


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial: a multiprocess test whose timing margins (straggler scores, the report that evicts) or exact "
        "recovery counts need the cores to itself; `make test` runs these one at a time, after the other "
        "multiprocess tests ran two at a time",
    )


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """~0.5M tokens from the first stdlib files; vocab 2048. Built once per test session."""
    from components.lib.tokendata import build_dataset, default_corpus

    out = tmp_path_factory.mktemp("data") / "stdlib"
    build_dataset(default_corpus(), out, vocab_size=2048, max_bytes=2_000_000, seed=0)
    return out
