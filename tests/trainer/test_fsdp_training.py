"""2-process gloo FSDP2 runs of the tiny model: the loss falls and identical runs end bit-identical."""

import pytest
import torch

from testlib import MICRO_MODEL, read_jsonl, torchrun
from trainer.checkpoint import load_model_weights

pytestmark = pytest.mark.multiprocess

STEPS = 30
# Small batches (2 x 64 tokens per rank, ~8x cheaper steps than the tiny preset's 8 x 128): the loss still falls by
# more than 1 nat in 30 steps (the first steps learn the token frequencies), and bit-identity does not depend on them.
# The final save is written inline (no background writer process per rank, which costs ~1.3 s of CPU to start): the
# same bytes (tests/checkpoint/test_resume.py::test_async_save_equals_sync_save).
SMALL_BATCHES = ["--train.batch_size=2", "--data.seq_len=64"]
# MICRO_MODEL: the loss still falls by 1.2 nats in 30 steps.


def _train(tmp_path, dataset, name, *extra):
    run_dir = tmp_path / name
    result = torchrun(
        ["--config", "tiny", f"--data.path={dataset}", f"--train.run_dir={run_dir}", f"--train.steps={STEPS}",
         "--checkpoint.interval=0", "--checkpoint.async_save=false", *SMALL_BATCHES, *MICRO_MODEL, *extra]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_loss_falls_and_identical_runs_are_bit_identical(tmp_path, tiny_dataset):
    run_a = _train(tmp_path, tiny_dataset, "a")
    records = read_jsonl(run_a / "metrics.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    first = sum(r["loss"] for r in steps[:3]) / 3
    last = sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    start = next(r for r in records if r["event"] == "start")
    assert start["world_size"] == 2 and start["device"] == "cpu"
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in steps)

    run_b = _train(tmp_path, tiny_dataset, "b")
    wa, wb = load_model_weights(run_a / "checkpoints"), load_model_weights(run_b / "checkpoints")
    assert wa.keys() == wb.keys() and len(wa) > 10
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs between identical runs"
    losses_a = [r["loss"] for r in steps]
    losses_b = [r["loss"] for r in read_jsonl(run_b / "metrics.jsonl") if r["event"] == "step"]
    assert losses_a == losses_b


def test_bad_config_exits_with_permanent_code(tmp_path, tiny_dataset):
    result = torchrun(["--config", "tiny", f"--data.path={tiny_dataset}", "--checkpoint.keep=1"], nproc=1)
    assert result.returncode != 0
    assert "checkpoint.keep must be >= 2" in result.stderr


def test_a_global_batch_trains_alike_on_any_world_size(tmp_path, tiny_dataset):
    """``train.global_batch=4``: two ranks of 2 (no accumulation), two ranks of 1 accumulating 2 micro-batches (FSDP2
    reduce-scatters once a step) and one rank of 2 accumulating 2 consume the same samples each step, so their losses
    agree within float32 summation-order noise (not bit-equal: the reductions run in another order)."""
    steps = 12
    runs = {"2x2": (2, 2), "2x1x2": (2, 1), "1x2x2": (1, 2)}
    losses, starts = {}, {}
    for name, (nproc, batch) in runs.items():
        run_dir = tmp_path / name
        result = torchrun(["--config", "tiny", f"--data.path={tiny_dataset}", f"--train.run_dir={run_dir}",
                           f"--train.steps={steps}", "--checkpoint.interval=0", "--checkpoint.async_save=false",
                           f"--train.batch_size={batch}", "--train.global_batch=4", "--data.seq_len=64", *MICRO_MODEL],
                          nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        records = read_jsonl(run_dir / "metrics.jsonl")
        losses[name] = [r["loss"] for r in records if r["event"] == "step"]
        starts[name] = next(r for r in records if r["event"] == "start")
    assert {name: s["accumulation"] for name, s in starts.items()} == {"2x2": 1, "2x1x2": 2, "1x2x2": 2}
    assert len({s["tokens_per_step"] for s in starts.values()}) == 1
    for name in ("2x1x2", "1x2x2"):
        assert len(losses[name]) == steps
        gap = max(abs(a - b) for a, b in zip(losses[name], losses["2x2"]))
        assert gap < 2e-3, f"{name}: losses differ by {gap} from two ranks without accumulation"
    assert losses["2x2"][-1] < losses["2x2"][0] - 0.3, "the runs did not train"


def test_a_global_batch_the_world_size_cannot_split_is_one_line_and_exit_2(tmp_path, tiny_dataset):
    result = torchrun(["--config", "tiny", f"--data.path={tiny_dataset}", f"--train.run_dir={tmp_path / 'run'}",
                       "--train.batch_size=2", "--train.global_batch=6"], nproc=2)
    assert result.returncode != 0 and "exitcode: 2" in result.stderr, result.stderr[-3000:]  # torchrun's: 1
    assert "config error: train.global_batch=6 is not a multiple of train.batch_size x world size = 2 x 2" in result.stderr
