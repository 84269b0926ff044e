"""trainer/compile_ahead.py: which Triton kernels a run's worker will call, with which sizes, worked out without a GPU
(the compile itself needs one: bench/compile_ahead_check.py checks on the device that the worker then compiles
nothing), and when the compiling process is started at all."""

import pytest
import torch

from testlib import write_token_shards
from trainer import compile_ahead
from trainer.config import load_config
from trainer.data import ShardError


def _cfg(*overrides: str, data: str = "/d"):
    return load_config("1b", [f"--data.path={data}", *overrides])


@pytest.fixture
def with_triton(monkeypatch):
    """Triton importable, as on a CUDA build (the choices ask ``parallel.triton_missing``)."""
    from trainer import optimizer, parallel

    monkeypatch.setattr(parallel, "triton_missing", lambda: "")
    monkeypatch.setattr(optimizer, "triton_missing", lambda: "")


def test_one_rank_eager_plans_every_kernel_with_the_runs_sizes(with_triton):
    plan = compile_ahead.plan(_cfg("--train.compile=false"), world_size=1)
    assert plan["which"] == {"loss", "swiglu"}  # no gradient pass: ...
    assert plan["adamw_coef"] is True  # ... auto's AdamW at one rank reads bf16 gradients and clipping's coefficient
    assert plan["vocab"] == 128256 and plan["dtype"] == torch.bfloat16
    assert plan["activation_numel"] == 4 * 4096 * 8192  # batch x sequence x FFN width
    assert len(plan["param_numels"]) == 147 and max(plan["param_numels"]) == 128256 * 2048


def test_compiled_fsdp_and_no_clipping_change_the_plan(with_triton):
    compiled = compile_ahead.plan(_cfg(), world_size=1)
    assert compiled["which"] == {"loss"}  # SwiGLU is Inductor's when compiled
    fsdp = compile_ahead.plan(_cfg("--train.compile=false"), world_size=2)
    assert fsdp["which"] == {"loss", "swiglu"} and fsdp["adamw_coef"] is None  # FSDP2: fused AdamW, no OneRank
    assert compile_ahead.plan(_cfg("--optim.grad_clip=0"), world_size=1)["adamw_coef"] is False
    fused = compile_ahead.plan(_cfg("--optim.implementation=fused"), world_size=1)
    assert fused["adamw_coef"] is None and fused["which"] == {"loss", "grad_upcast"}  # OneRank's gradient pass
    assert compile_ahead.plan(_cfg("--train.mixed_precision=fp32"), world_size=1)["dtype"] == torch.float32


def test_without_triton_nothing_is_planned(monkeypatch):
    from trainer import optimizer, parallel

    monkeypatch.setattr(parallel, "triton_missing", lambda: "No module named 'triton'")
    monkeypatch.setattr(optimizer, "triton_missing", lambda: "No module named 'triton'")
    plan = compile_ahead.plan(_cfg(), world_size=1)
    assert not plan["which"] and plan["adamw_coef"] is None


def test_vocabulary_from_the_manifest_and_a_remote_base_model_is_not_fetched(with_triton, tmp_path):
    data = write_token_shards(tmp_path / "data", [40], vocab_size=4096)
    assert compile_ahead.plan(_cfg("--model.vocab_size=0", data=str(data)), 1)["vocab"] == 4096
    with pytest.raises(ShardError, match="manifest.json not found"):
        compile_ahead.plan(_cfg("--model.vocab_size=0", data=str(tmp_path / "missing")), 1)
    with pytest.raises(ValueError, match="not a local directory"):
        compile_ahead.plan(_cfg("--model.from_hf=hf://org/model"), 1)


def test_started_only_from_local_rank_0_on_an_nvidia_machine_for_a_run_that_uses_the_kernels(monkeypatch):
    monkeypatch.setattr(compile_ahead.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    assert compile_ahead.wanted(_cfg())
    assert not compile_ahead.wanted(_cfg("--train.device=cpu"))
    assert not compile_ahead.wanted(_cfg("--train.kernels=torch", "--optim.implementation=fused"))
    assert compile_ahead.wanted(_cfg("--train.kernels=torch"))  # auto's AdamW may still be Triton's
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not compile_ahead.wanted(_cfg())
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(compile_ahead.ENV, "0")
    assert not compile_ahead.wanted(_cfg())
    monkeypatch.setenv(compile_ahead.ENV, "started")  # entrypoint.sh started the node's one already
    assert not compile_ahead.wanted(_cfg())
    monkeypatch.setenv(compile_ahead.ENV, "1")
    assert compile_ahead.wanted(_cfg())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted worker: the first attempt filled the cache
    assert not compile_ahead.wanted(_cfg())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(compile_ahead.os.path, "exists", lambda path: False)  # no NVIDIA driver: a CPU machine
    assert not compile_ahead.wanted(_cfg()) and compile_ahead.spawn([], _cfg()) is None


def test_the_compiling_process_leaves_bad_arguments_and_cpu_runs_to_the_worker_silently(capsys):
    """Started by entrypoint.sh with the trainer's arguments before any worker: a bad flag or value is the worker's
    one line to report (not a second copy from here), and a CPU run has nothing to compile."""
    assert compile_ahead.main(["--config", "1b", "--data.path=/d", "--no-such-flag"]) == 0
    assert compile_ahead.main(["--config", "1b", "--data.path=/d", "--train.steps=-1"]) == 0
    assert compile_ahead.main(["--config", "1b", "--data.path=/d", "--train.device=cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_without_nvml_the_process_gives_up_in_one_line_after_planning(with_triton, capsys):
    """A plan with kernels in it, on a machine whose NVML has no GPU (this one): the compile target must come from
    NVML (never Triton's own, which would make a CUDA context beside the worker's), so nothing is compiled."""
    assert compile_ahead.main(["--config", "1b", "--data.path=/d", "--train.compile=false"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer.compile_ahead: nothing compiled ahead ("), lines
    assert "NVML" in lines[0] or "pynvml" in lines[0], lines
