"""Shared fixtures; plain helpers live in ``testlib.py`` (one module name for every test directory)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest


# `make test` runs the multiprocess tests on two xdist workers a module at a time (--dist loadscope, in this
# order: --no-loadscope-reorder), so the longest modules go first and none is left to run alone at the end (each
# module's time: BENCHMARKS.md, "The suite's time", bench/results/suite-time/cpu-2026-12-06-5cb1985/test-cpu-summary.txt).
LONGEST_FIRST = (
    "tests/resiliency/test_recovery.py", "tests/pipelines/test_local_pipeline.py", "tests/hf/test_hf_training.py",
    "tests/resiliency/test_elastic.py", "tests/resiliency/test_node_memory.py", "tests/resiliency/test_exit_contract.py",
    "tests/trainer/test_fsdp_training.py", "tests/checkpoint/test_resume.py", "tests/pipelines/test_notebook.py",
    "tests/resiliency/test_recovery_exits.py", "tests/checkpoint/test_tiers.py",
)


# The single-process tests run on xdist workers in `--dist load`, which hands them out in this order: the longest
# (Inductor's C++ compiles on CPU, the corpus bound, the stub-cluster sweeps behind the RBAC check) go first, so
# none of them starts last and leaves the other workers idle.
LONGEST_SINGLE_FIRST = (
    "tests/unit/test_kernels.py", "tests/unit/test_onerank_reshard.py", "tests/unit/test_onerank.py",
    "tests/unit/test_corpus.py", "tests/deploy/test_rbac.py", "tests/checkpoint/test_manager.py",
    "tests/launcher/test_backends.py", "tests/launcher/test_launcher.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate((*LONGEST_FIRST, *LONGEST_SINGLE_FIRST))}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: else as found


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Not even imported: a test module none of whose tests the ``-m`` expression can select. Every collecting
    process imports every module (~20 s of CPU for this suite: torch, kfp, transformers), and `make test`'s
    multi-process and serial parts select a few modules only. A test carries a marker only if its module's text
    names it (``pytest.mark.NAME``; no conftest adds one), so the module may be skipped when no combination of the
    expression's markers that its text names satisfies the expression. Anything unusual (a marker with arguments,
    a file that cannot be read): collected as usual."""
    expr = config.option.markexpr
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    words = set(re.findall(r"[A-Za-z_]\w*", expr)) - {"and", "or", "not"}
    if not re.fullmatch(r"[\w\s()]*", expr) or not words:
        return None
    try:
        text = collection_path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    named = sorted(w for w in words if w in text)
    for k in range(len(named) + 1):
        for carried in itertools.combinations(named, k):
            as_python = re.sub(r"[A-Za-z_]\w*", lambda m: str(m[0] in carried) if m[0] in words else m[0], expr)
            if eval(as_python, {"__builtins__": {}}):  # noqa: S307 - True, False, and, or, not, parentheses
                return None
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial: a multiprocess test whose timing margins (straggler scores, the report that evicts) or exact "
        "recovery counts need the cores to itself; `make test` runs these one at a time, after the other "
        "multiprocess tests ran two at a time",
    )


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """~0.5M tokens from the first stdlib files; vocab 2048. Built once per pytest session."""
    from components.lib.tokendata import build_dataset, default_corpus

    out = tmp_path_factory.mktemp("data") / "stdlib"
    build_dataset(default_corpus(), out, vocab_size=2048, max_bytes=2_000_000, seed=0)
    return out
