"""The warm-up of a process's kernels (trainer/startup/warmup.py): what the run calls (``plan``), the compile stage
with no device, the load stage, and its three callers: the compiling process, a warm standby, a new GPU worker.

Its effects are measured on the GPU (BENCHMARKS.md, "First step of a new worker"; ``bench/cold_phases.py``;
``bench/compile_ahead_check.py`` checks on the device that the worker then compiles nothing); here, on CPU, the
parts that decide what runs: the plan, the configurations of the load stage, its model and optimizer passes (no RNG
stream of the run drawn from), the memory rule, the standby's first-step marker and the callers' skip rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from testlib import REPO, write_token_shards
from trainer.config import load_config
from trainer.data import ShardError
from trainer.startup import phases, warmup
from trainer.startup.standby import DEFAULT_TARGET, Standby


def _cfg(*overrides: str, data: str = "/d"):
    return load_config("1b", [f"--data.path={data}", *overrides])


@pytest.fixture
def with_triton(monkeypatch):
    """Triton importable, as on a CUDA build (the choices ask ``parallel.triton_missing``)."""
    from trainer import optimizer, parallel

    monkeypatch.setattr(parallel, "triton_missing", lambda: "")
    monkeypatch.setattr(optimizer, "triton_missing", lambda: "")


# --- the plan and the compile stage -----------------------------------------------------------------------------

def test_one_rank_eager_plans_every_kernel_with_the_runs_sizes(with_triton):
    planned = warmup.plan(_cfg("--train.compile=false"), world_size=1)
    assert planned.adamw == "triton" and planned.one_rank
    details = planned.compile_arguments()
    assert details["which"] == {"loss", "swiglu"}  # no gradient pass: ...
    assert details["adamw_coef"] is True  # ... auto's AdamW at one rank reads bf16 gradients and clipping's coefficient
    assert details["vocab"] == 128256 and details["dtype"] == torch.bfloat16
    assert details["activation_numel"] == 4 * 4096 * 8192  # batch x sequence x FFN width
    assert len(details["param_numels"]) == 147 and max(details["param_numels"]) == 128256 * 2048


def test_compiled_fsdp_and_no_clipping_change_the_plan(with_triton):
    def details(*flags: str, world_size: int = 1) -> dict:
        return warmup.plan(_cfg(*flags), world_size).compile_arguments()

    assert details()["which"] == {"loss"}  # SwiGLU is Inductor's when compiled
    fsdp = details("--train.compile=false", world_size=2)
    assert fsdp["which"] == {"loss", "swiglu"} and fsdp["adamw_coef"] is None  # FSDP2: fused AdamW, no OneRank
    assert details("--optim.grad_clip=0")["adamw_coef"] is False
    fused = details("--optim.implementation=fused")
    assert fused["adamw_coef"] is None and fused["which"] == {"loss", "grad_upcast"}  # OneRank's gradient pass
    assert details("--train.mixed_precision=fp32")["dtype"] == torch.float32


def test_without_triton_nothing_is_planned(monkeypatch):
    from trainer import optimizer, parallel

    monkeypatch.setattr(parallel, "triton_missing", lambda: "No module named 'triton'")
    monkeypatch.setattr(optimizer, "triton_missing", lambda: "No module named 'triton'")
    details = warmup.plan(_cfg(), world_size=1).compile_arguments()
    assert not details["which"] and details["adamw_coef"] is None


def test_vocabulary_from_the_manifest_and_a_remote_base_model_is_not_fetched(tmp_path):
    data = write_token_shards(tmp_path / "data", [40], vocab_size=4096)
    cfg = _cfg("--model.vocab_size=0", data=str(data))
    warmup.resolve_shape(cfg)
    assert cfg.model.vocab_size == 4096
    with pytest.raises(ShardError, match="manifest.json not found"):
        warmup.resolve_shape(_cfg("--model.vocab_size=0", data=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="not a local directory"):
        warmup.resolve_shape(_cfg("--model.from_hf=hf://org/model"))


def test_started_only_from_local_rank_0_on_an_nvidia_machine_for_a_run_that_uses_the_kernels(monkeypatch):
    monkeypatch.setattr(warmup.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(warmup.ENV, raising=False)
    assert warmup.wanted(_cfg())
    assert not warmup.wanted(_cfg("--train.device=cpu"))
    assert not warmup.wanted(_cfg("--train.kernels=torch", "--optim.implementation=fused"))
    assert warmup.wanted(_cfg("--train.kernels=torch"))  # auto's AdamW may still be Triton's
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not warmup.wanted(_cfg())
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(warmup.ENV, "0")
    assert not warmup.wanted(_cfg())
    monkeypatch.setenv(warmup.ENV, "started")  # entrypoint.sh started the node's one already
    assert not warmup.wanted(_cfg())
    monkeypatch.setenv(warmup.ENV, "1")
    assert warmup.wanted(_cfg())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted worker: the first attempt filled the cache
    assert not warmup.wanted(_cfg())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(warmup.os.path, "exists", lambda path: False)  # no NVIDIA driver: a CPU machine
    assert not warmup.wanted(_cfg()) and warmup.spawn([], _cfg()) is None


def test_the_compiling_process_leaves_bad_arguments_and_cpu_runs_to_the_worker_silently(capsys):
    """Started by entrypoint.sh with the trainer's arguments before any worker: a bad flag or value is the worker's
    one line to report (not a second copy from here), and a CPU run has nothing to compile."""
    assert warmup.compile_ahead(["--config", "1b", "--data.path=/d", "--no-such-flag"]) == 0
    assert warmup.compile_ahead(["--config", "1b", "--data.path=/d", "--train.steps=-1"]) == 0
    assert warmup.compile_ahead(["--config", "1b", "--data.path=/d", "--train.device=cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_without_nvml_the_process_gives_up_in_one_line_after_planning(with_triton, capsys):
    """A plan with kernels in it, on a machine whose NVML has no GPU (this one): the compile target must come from
    NVML (never Triton's own, which would make a CUDA context beside the worker's), so nothing is compiled."""
    assert warmup.compile_ahead(["--config", "1b", "--data.path=/d", "--train.compile=false"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer.startup.warmup: nothing compiled ahead ("), lines
    assert "NVML" in lines[0] or "pynvml" in lines[0], lines


def test_the_compile_stage_runs_as_entrypoint_sh_starts_it():
    """``python -m trainer.startup.warmup <the trainer's arguments>`` (entrypoint.sh, ``spawn``): a run with
    nothing to compile ends at once, silently, with 0; an unknown module name would end 1 with a traceback."""
    done = subprocess.run([sys.executable, "-m", warmup.PROG, "--config", "1b", "--data.path=/d",
                           "--train.device=cpu"], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO / "trainer_image")})
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert f"python3 -m {warmup.PROG} \"$@\"" in (REPO / "trainer_image/entrypoint.sh").read_text()


# --- the load stage ---------------------------------------------------------------------------------------------

def test_warm_config_keeps_every_shape_of_the_run_but_the_depth():
    cfg = _cfg("--model.from_hf=/models/x")
    one = warmup.warm_config(cfg)
    assert (one.model.dim, one.model.n_heads, one.model.n_kv_heads, one.model.ffn_dim, one.model.vocab_size,
            one.data.seq_len, one.train.batch_size) == (cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads,
                                                        cfg.model.ffn_dim, cfg.model.vocab_size, cfg.data.seq_len,
                                                        cfg.train.batch_size)
    assert (one.model.n_layers, one.model.from_hf, cfg.model.n_layers, cfg.model.from_hf) == (1, "", 16, "/models/x")
    # 1b: 4 x 4096 tokens, vocabulary 128256: the logits dominate (8 bytes an entry: an fp32 loss's share)
    assert 20 * 2**30 < warmup.estimate_bytes(one) < 24 * 2**30


def test_a_standbys_small_config_keeps_the_shape_of_a_block_and_shrinks_the_rest():
    cfg = _cfg("--train.compile=true")
    small = warmup.warm_config(cfg, small=True)
    assert (small.model.dim, small.model.n_heads, small.model.n_kv_heads, small.model.ffn_dim) == \
        (cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim)
    assert (small.model.n_layers, small.model.vocab_size, small.data.seq_len, small.train.batch_size) == (1, 4096, 512, 1)
    assert not small.train.compile and cfg.train.compile and cfg.model.n_layers == 16  # a copy
    assert 0.5 * 2**30 < warmup.estimate_bytes(small) < 1 * 2**30
    assert warmup.warm_config(load_config("tiny", ["--data.path=d"]), small=True).model.vocab_size == 4096  # from data


def test_integer_classes_stand_in_for_each_specialisation_of_the_run_sizes():
    assert warmup.integer_classes([2048 * 8192, 2048, 1]) == [1, 4096]
    assert warmup.integer_classes([4097, 30]) == [4095]  # neither 1 nor a multiple of 16
    assert warmup.integer_classes([2**31 + 16]) == []  # 64-bit: left to the run


@pytest.mark.parametrize("small", [False, True])
def test_model_and_optimizer_passes_run_the_trainers_code_and_draw_from_no_rng(small):
    cfg = load_config("tiny", ["--data.path=d", "--train.device=cpu", "--model.vocab_size=512", "--data.seq_len=32",
                               "--train.batch_size=2"])
    torch.manual_seed(7)
    before = torch.get_rng_state()
    triton = warmup._model_pass(warmup.warm_config(cfg, small), torch.device("cpu"))
    line = warmup._optimizer_pass(warmup.plan(cfg, 1, torch.device("cpu")), torch.device("cpu"))
    assert triton == frozenset()  # no Triton kernel on the CPU
    assert line == "for_loop on 1 size class(es)", line
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("small, free_gib, line", [
    (False, 20, "skipped: 20.0 GiB free on cuda:0, the warm-up needs 22.0 GiB (twice that free)"),
    (True, 1, "skipped: 1.0 GiB free on cuda:0, the warm-up needs 0.7 GiB (twice that free)"),
])
def test_skipped_when_the_device_lacks_twice_its_memory(monkeypatch, small, free_gib, line):
    cfg = _cfg("--train.compile=false")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * 2**30, 141 * 2**30))
    assert warmup.warm(cfg, torch.device("cuda", 0), 1, small=small) == line


@pytest.mark.parametrize("world_size, coef", [(1, True), (2, False)])
def test_the_triton_adamw_is_warmed_as_the_run_calls_it(monkeypatch, world_size, coef):
    """One rank: OneRank hands it the compute-dtype gradients with clipping's coefficient; FSDP2: fp32 gradients,
    clipped already (no coefficient). Triton is not on this machine: a stand-in records the calls."""
    from trainer import optimizer

    calls = []
    fake = types.ModuleType("trainer.kernels")
    fake.adamw_step = lambda param, grad, m, v, c, **kw: calls.append((param.numel(), grad.dtype, c is not None))
    monkeypatch.setitem(sys.modules, "trainer.kernels", fake)
    monkeypatch.setattr(optimizer, "adamw_implementation", lambda *args, **kw: "triton")
    cfg = load_config("tiny", ["--data.path=d", "--train.device=cpu", "--optim.grad_clip=1.0", "--model.vocab_size=512"])
    line = warmup._optimizer_pass(warmup.plan(cfg, world_size, torch.device("cpu")), torch.device("cpu"))
    assert line == "triton on 1 size class(es)"
    assert calls == [(4096, torch.float32, coef)]


# --- a new worker: in a background thread -----------------------------------------------------------------------

def test_the_thread_runs_on_the_workers_device_and_reports_a_failure_as_one_line(monkeypatch):
    cfg = load_config("tiny", ["--data.path=d"])
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)  # no GPU here: the thread's device is recorded
    monkeypatch.setattr(warmup, "warm", lambda cfg, device, world_size: f"warmed on {device} at {world_size}")
    assert warmup.InBackground(cfg, torch.device("cuda", 1), 4).wait() == "warmed on cuda:1 at 4"
    assert current == [torch.device("cuda", 1)]

    def broken(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB\nmore")

    monkeypatch.setattr(warmup, "warm", broken)
    assert warmup.InBackground(cfg, torch.device("cuda", 0), 1).wait() == (
        "failed (OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB); the first step loads what it "
        "needs itself")


@pytest.mark.parametrize("flags, warmed, device, runs", [
    ([], False, "cuda", True),
    (["--resiliency.start_warmup=false"], False, "cuda", False),
    (["--train.compile=true"], False, "cuda", False),  # Inductor's kernels: its cache serves them
    ([], True, "cuda", False),  # a standby's worker: its standby warmed it
    ([], False, "cpu", False),
])
def test_a_new_worker_warms_up_only_when_eager_on_a_gpu_and_not_warmed_by_its_standby(monkeypatch, flags, warmed,
                                                                                       device, runs):
    cfg = _cfg("--train.compile=false", *flags)
    monkeypatch.setattr(warmup, "STANDBY_WARMED", warmed)
    monkeypatch.setattr(warmup, "InBackground", lambda *args: "started")
    assert (warmup.for_new_worker(cfg, torch.device(device), 1) == "started") is runs


# --- a warm standby: synchronously, at small shapes, from the first-step marker -----------------------------------

def test_first_step_marker_records_the_command_line_directory_and_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv(phases.STANDBY_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(sys, "argv", ["trainer", "--config", "tiny", "--train.steps=7"])
    monkeypatch.chdir(tmp_path)
    phases.first_step_done(["/dev/shm/x/rank-00001.slot-0.data"])
    record = json.loads((tmp_path / "first-step-1").read_text())
    assert record == {"argv": ["--config", "tiny", "--train.steps=7"], "cwd": str(tmp_path), "world_size": 8,
                      "snapshot_files": ["/dev/shm/x/rank-00001.slot-0.data"]}
    assert [p.name for p in tmp_path.iterdir()] == ["first-step-1"]  # written whole, no partial file left


def _note(tmp_path, monkeypatch, content: str | None) -> str:
    monkeypatch.chdir(tmp_path)  # the standby changes to the worker's directory
    if content is not None:
        (tmp_path / "first-step-0").write_text(content)
    standby = Standby(0, str(tmp_path), DEFAULT_TARGET, None)
    standby.device = torch.device("cpu")
    return standby._prewarm()


def test_standby_warms_up_from_the_markers_command_line_and_world_size(tmp_path, monkeypatch):
    record = {"argv": ["--config", "tiny", "--data.path=data"], "cwd": str(tmp_path)}
    assert _note(tmp_path, monkeypatch, json.dumps(record)) == "; prewarm nothing to warm on the CPU"
    calls = []
    monkeypatch.setattr(warmup, "warm", lambda cfg, device, world_size, small: calls.append((world_size, small)) or
                        "warmed")
    monkeypatch.setattr(warmup, "STANDBY_WARMED", False)
    assert _note(tmp_path, monkeypatch, json.dumps({**record, "world_size": 16})) == "; prewarm warmed"
    assert calls == [(16, True)] and warmup.STANDBY_WARMED  # the worker it becomes skips its own warm-up


def test_a_skipped_standby_warm_up_leaves_the_worker_its_own(monkeypatch):
    monkeypatch.setattr(warmup, "STANDBY_WARMED", False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**29, 141 * 2**30))
    line = warmup.for_standby(_cfg(), torch.device("cuda", 0), 1)
    assert line.startswith("skipped: 0.5 GiB free on cuda:0") and not warmup.STANDBY_WARMED


@pytest.mark.parametrize("content, why", [
    (None, "no prewarm (the first-step marker holds no command line: FileNotFoundError)"),
    ("", "no prewarm (the first-step marker holds no command line: JSONDecodeError)"),
    (json.dumps({"argv": ["--config", "tiny"], "cwd": ".", "world_size": "many"}),
     "no prewarm (the first-step marker holds no command line: ValueError)"),
    (json.dumps({"argv": ["--config", "tiny", "--data.path=d", "--resiliency.standby_prewarm=false"], "cwd": "."}),
     "no prewarm (resiliency.standby_prewarm=false)"),
    (json.dumps({"argv": ["--config", "tiny", "--data.path=d", "--train.steps=many"], "cwd": "."}),
     "no prewarm (ConfigError: "),
    (json.dumps({"argv": ["--config", "tiny", "stray"], "cwd": "."}), "no prewarm (SystemExit: 2)"),
])
def test_standby_without_a_usable_command_line_stays_warm_and_says_why(tmp_path, monkeypatch, content, why):
    assert _note(tmp_path, monkeypatch, content).startswith(f"; {why}")


def test_the_standby_keeps_its_environment_whatever_the_warm_up_sets(tmp_path, monkeypatch):
    def setting_warm_up(cfg, device, world_size):  # as Inductor's import did on H200 (TORCHINDUCTOR_CACHE_DIR)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/set-by-the-warm-up"
        return "warmed"

    monkeypatch.setattr(warmup, "for_standby", setting_warm_up)
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


@pytest.mark.parametrize("warmed, taken, runs", [(False, [], True), (True, [], True), (False, [1 << 30], True),
                                                 (True, [1 << 30], False)])
def test_restore_warm_up_is_skipped_only_in_a_standby_warmed_worker_whose_slots_were_page_locked_ahead(
        monkeypatch, warmed, taken, runs):
    """The restore's warm-up hides a new process's lazy initialisation behind a long copy; in a standby's worker
    whose slots the standby page-locked ahead the copy is short and the kernels are loaded, so it only lengthens
    the restore (on an H200 with 1b the in-job restart is shorter without it)."""
    from types import SimpleNamespace

    from trainer import train
    from trainer.checkpoint import premap

    monkeypatch.setattr(warmup, "STANDBY_WARMED", warmed)
    monkeypatch.setattr(premap, "TAKEN", taken)
    calls = []
    monkeypatch.setattr(train, "warm_up_step", lambda *args: calls.append(args))
    cfg = load_config("tiny", ["--data.path=d"])
    res = SimpleNamespace(cfg=cfg, device=torch.device("cuda", 0), warm=False)
    warm_up = train._warmup(res, model=lambda: None)
    warm_up()
    assert bool(calls) == runs and res.warm == runs
