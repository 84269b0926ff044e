"""The warm standby's prewarm (trainer/prewarm.py): the worker's command line goes from its first-step marker to
the standby, which trains a small copy of the configured model with the trainer's own code and frees it.

The GPU effect is measured by ``bench/cold_phases.py``; here, on CPU, the parts that decide what
runs: the marker's record, its parsing by the standby, the small configuration and the memory rule."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist

from trainer import startup
from trainer.config import load_config
from trainer.prewarm import BYTES_PER_PARAM, one_step, prewarm, small_config
from trainer.warmstart import estimate_bytes
from trainer.standby import DEFAULT_TARGET, Standby


def test_first_step_marker_records_the_command_line_and_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(startup.STANDBY_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(sys, "argv", ["trainer", "--config", "tiny", "--train.steps=7"])
    monkeypatch.chdir(tmp_path)
    startup.first_step_done(["/dev/shm/x/rank-00001.slot-0.data"])
    record = json.loads((tmp_path / "first-step-1").read_text())
    assert record == {"argv": ["--config", "tiny", "--train.steps=7"], "cwd": str(tmp_path),
                      "snapshot_files": ["/dev/shm/x/rank-00001.slot-0.data"]}
    assert [p.name for p in tmp_path.iterdir()] == ["first-step-1"]  # written whole, no partial file left


def _note(tmp_path, monkeypatch, content: str | None) -> str:
    monkeypatch.chdir(tmp_path)  # the standby changes to the worker's directory
    if content is not None:
        (tmp_path / "first-step-0").write_text(content)
    standby = Standby(0, str(tmp_path), DEFAULT_TARGET, None)
    standby.device = torch.device("cpu")
    return standby._prewarm()


def test_standby_prewarms_from_the_markers_command_line(tmp_path, monkeypatch):
    record = {"argv": ["--config", "tiny", "--data.path=data"], "cwd": str(tmp_path)}
    assert _note(tmp_path, monkeypatch, json.dumps(record)) == "; prewarm nothing to warm on the CPU"


@pytest.mark.parametrize("content, why", [
    (None, "no prewarm (the first-step marker holds no command line: FileNotFoundError)"),
    ("", "no prewarm (the first-step marker holds no command line: JSONDecodeError)"),
    (json.dumps({"argv": ["--config", "tiny", "--data.path=d", "--resiliency.standby_prewarm=false"], "cwd": "."}),
     "no prewarm (resiliency.standby_prewarm=false)"),
    (json.dumps({"argv": ["--config", "tiny", "--data.path=d", "--train.steps=many"], "cwd": "."}),
     "no prewarm (ConfigError: "),
    (json.dumps({"argv": ["--config", "tiny", "stray"], "cwd": "."}), "no prewarm (SystemExit: 2)"),
])
def test_standby_without_a_usable_command_line_stays_warm_and_says_why(tmp_path, monkeypatch, content, why):
    assert _note(tmp_path, monkeypatch, content).startswith(f"; {why}")


def test_small_config_keeps_the_shape_of_a_block_and_shrinks_the_rest():
    cfg = load_config("1b", ["--data.path=d", "--train.compile=true"])
    small = small_config(cfg)
    assert (small.model.dim, small.model.n_heads, small.model.n_kv_heads, small.model.ffn_dim) == \
        (cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim)
    assert (small.model.n_layers, small.model.vocab_size, small.data.seq_len, small.train.batch_size) == (1, 4096, 512, 1)
    assert not small.train.compile and cfg.train.compile and cfg.model.n_layers == 16  # a copy
    assert 1 * 2**30 < estimate_bytes(small, BYTES_PER_PARAM) < 2 * 2**30


def test_prewarm_is_skipped_when_the_device_lacks_twice_its_memory(monkeypatch):
    cfg = load_config("1b", ["--data.path=d"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 2**30, 141 * 2**30))
    line = prewarm(cfg, torch.device("cuda", 0))
    assert line.startswith("skipped: 2.0 GiB free on cuda:0, the warm-up needs 1.5 GiB"), line


def test_one_step_trains_the_small_model_and_leaves_no_process_group():
    small = small_config(load_config("tiny", ["--data.path=d"]), tokens=64)
    one_step(small, torch.device("cpu"))
    assert not dist.is_initialized()


def test_the_standby_keeps_its_environment_whatever_the_prewarm_sets(tmp_path, monkeypatch):
    import os

    import trainer.prewarm

    def setting_prewarm(cfg, device):  # as Inductor's import did on H200 (TORCHINDUCTOR_CACHE_DIR)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/set-by-the-warm-up"
        return "warmed"

    monkeypatch.setattr(trainer.prewarm, "prewarm", setting_prewarm)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = dict(os.environ)
    record = {"argv": ["--config", "tiny", "--data.path=data"], "cwd": str(tmp_path)}
    assert _note(tmp_path, monkeypatch, json.dumps(record)) == "; prewarm warmed"
    assert dict(os.environ) == before  # the handoff compares it with the worker's (import_time_mismatch)


@pytest.mark.parametrize("extra, files, note", [
    (["--resiliency.standby_premap=false"], ["/dev/shm/x/rank-00000.slot-0.data"],
     "; no premap (resiliency.standby_premap=false)"),
    ([], [], ""),  # no node-local tier: nothing to page-lock
])
def test_standby_premaps_only_the_slot_files_the_marker_names_when_on(tmp_path, monkeypatch, extra, files, note):
    record = {"argv": ["--config", "tiny", "--data.path=data", *extra], "cwd": str(tmp_path), "snapshot_files": files}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "first-step-0").write_text(json.dumps(record))
    standby = Standby(0, str(tmp_path), DEFAULT_TARGET, None)
    standby.device = torch.device("cpu")
    standby._prewarm()
    assert standby.snapshot_files == files
    assert standby._premap() == note and standby.premapper is None


@pytest.mark.parametrize("prewarmed, taken, runs", [(False, [], True), (True, [], True), (False, [1 << 30], True),
                                                    (True, [1 << 30], False)])
def test_restore_warm_up_is_skipped_only_in_a_prewarmed_worker_whose_slots_were_page_locked_ahead(
        monkeypatch, prewarmed, taken, runs):
    """The restore's warm-up hides a new process's lazy initialisation behind a long copy; in a standby's worker
    whose slots the standby page-locked ahead the copy is short and the kernels are loaded, so it only lengthens
    the restore (on an H200 with 1b the in-job restart is shorter without it)."""
    from types import SimpleNamespace

    from trainer import train
    from trainer.checkpoint import premap

    monkeypatch.setattr(startup, "PREWARMED", prewarmed)
    monkeypatch.setattr(premap, "TAKEN", taken)
    calls = []
    monkeypatch.setattr(train, "warm_up_step", lambda *args: calls.append(args))
    cfg = load_config("tiny", ["--data.path=d"])
    res = SimpleNamespace(cfg=cfg, device=torch.device("cuda", 0), warm=False)
    warm_up = train._warmup(res, model=lambda: None)
    warm_up()
    assert bool(calls) == runs and res.warm == runs
