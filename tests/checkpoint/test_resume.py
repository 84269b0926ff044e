"""2-rank gloo runs of the trainer: bit-exact resume, async == sync, 2 -> 1 resharding, SIGKILL mid-write."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from testlib import MICRO_MODEL, REPO, VENV_BIN, read_jsonl, torchrun
from trainer.checkpoint import FAULT_ENV, CheckpointManager, committed_steps, find_valid_checkpoint, load_model_weights
from trainer.config import load_config
from trainer.data import ShardedTokens, TokenLoader
from trainer.model import Transformer
from trainer.parallel import DistEnv
from trainer.train import TrainProgress, build_model, build_optimizer

pytestmark = pytest.mark.multiprocess

N = 6
# Small batches (~8x cheaper steps than the preset's 8 x 128 tokens per rank): bit-exactness does not depend on them.
BATCH, SEQ = 2, 64  # per rank; the one-process loads below read the global batch, both ranks' halves
GLOBAL_BATCH = 2 * BATCH


def _args(dataset: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", "tiny", f"--data.path={dataset}", f"--train.run_dir={run_dir}", f"--train.steps={steps}",
            "--optim.warmup_steps=0", "--optim.min_lr_ratio=1.0",  # constant LR: independent of train.steps
            f"--train.batch_size={BATCH}", f"--data.seq_len={SEQ}",
            f"--checkpoint.node_local_dir={run_dir}-node",  # not /dev/shm: a killed run leaves its slots
            *MICRO_MODEL, *extra]


def _run(*args: str) -> None:
    result = torchrun(list(args))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dataset):
    """A: 2N steps straight, async saves every N. B: N steps with synchronous saves, then resumed to 2N."""
    root = tmp_path_factory.mktemp("resume")
    straight, split = root / "straight", root / "split"
    # the step-N write must commit even when it is still in flight at the last step (a loaded machine)
    _run(*_args(tiny_dataset, straight, 2 * N, f"--checkpoint.interval={N}", "--checkpoint.final_cancels_older_write=false"))
    _run(*_args(tiny_dataset, split, N, "--checkpoint.async_save=false"))
    _run(*_args(tiny_dataset, split, 2 * N, "--checkpoint.async_save=false"))
    return straight, split


def _shard_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(step_dir.glob("shard-*.pt")):
        blob = torch.load(shard, weights_only=True)
        out.update({f"{shard.name}:{k}": v for k, v in blob["tensors"].items()})
    return out


def _rng(step_dir: Path) -> list[torch.Tensor]:
    return [torch.load(s, weights_only=True)["rank_state"]["progress"]["rng_cpu"] for s in sorted(step_dir.glob("shard-*.pt"))]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 50
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def test_resume_is_bit_exact(runs):
    straight, split = runs
    step = f"step-{2 * N:08d}"
    _assert_same(_shard_tensors(straight / "checkpoints" / step), _shard_tensors(split / "checkpoints" / step))
    losses_a = {r["step"]: r["loss"] for r in read_jsonl(straight / "metrics.jsonl") if r["event"] == "step"}
    records_b = read_jsonl(split / "metrics.jsonl")
    assert any(r["event"] == "resume" and r["step"] == N for r in records_b)
    losses_b = {r["step"]: r["loss"] for r in records_b if r["event"] == "step"}
    assert [losses_a[s] for s in range(N + 1, 2 * N + 1)] == [losses_b[s] for s in range(N + 1, 2 * N + 1)]
    # Each process starts with its own CPU RNG seed and training draws nothing from it: the resumed process ends
    # with the RNG state it restored at step N, not its own.
    for restored, final in zip(_rng(split / "checkpoints" / f"step-{N:08d}"), _rng(split / "checkpoints" / step)):
        assert torch.equal(restored, final)


def test_async_save_equals_sync_save(runs):
    straight, split = runs
    step = f"step-{N:08d}"  # async (straight run, mid-run) vs synchronous (split run, its last step)
    _assert_same(_shard_tensors(straight / "checkpoints" / step), _shard_tensors(split / "checkpoints" / step))


def test_two_rank_checkpoint_loads_in_one_process(runs, tiny_dataset, tmp_path):
    straight, split = runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight / "checkpoints" / f"step-{N:08d}", ckpt / f"step-{N:08d}")
    cfg = load_config("tiny", [*MICRO_MODEL, f"--data.path={tiny_dataset}", f"--train.batch_size={GLOBAL_BATCH}",
                               f"--data.seq_len={SEQ}", f"--checkpoint.dir={ckpt}",
                               f"--checkpoint.node_local_dir={tmp_path / 'node'}"])
    dataset = ShardedTokens(tiny_dataset, verify=False)
    cfg.model.vocab_size = dataset.vocab_size
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mgr = CheckpointManager(cfg.checkpoint, ckpt, DistEnv(0, 1, 0, 1), cfg.to_json())
    try:
        mgr.bind()
        model = build_model(cfg, torch.device("cpu"))
        loader = TokenLoader(dataset, cfg.data.seq_len, GLOBAL_BATCH, 0, 1, cfg.data.seed)
        state = {"model": model, "optimizer": build_optimizer(model, cfg.optim), "progress": TrainProgress(),
                 "dataloader": loader}
        assert mgr.load_latest(state) == N and state["progress"].step == N
        inputs, targets = loader.next_batch()  # the global batch of step N + 1, both ranks' halves
        with torch.no_grad():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1)).item()
    finally:
        mgr.close()
        dist.destroy_process_group()
    # The 2-rank run computed the loss of step N + 1 with exactly these weights (before its update).
    logged = next(r["loss"] for r in read_jsonl(split / "metrics.jsonl") if r["event"] == "step" and r["step"] == N + 1)
    assert loss == pytest.approx(logged, rel=1e-5)
    # The plain (unsharded) model built from load_model_weights gives the same logits.
    plain = Transformer(cfg.model, max_seq_len=cfg.data.seq_len)
    plain.init_weights(0)
    plain.load_state_dict(load_model_weights(ckpt))
    with torch.no_grad():
        torch.testing.assert_close(plain(inputs), logits, rtol=1e-5, atol=1e-5)


def test_a_resume_on_fewer_ranks_with_the_same_global_batch_trains_like_the_run_it_continues(runs, tiny_dataset,
                                                                                            tmp_path):
    """Two ranks' checkpoint of step N resumed on one rank with ``train.global_batch`` = both ranks' batch (two
    micro-batches accumulated): the same samples each step, the losses of steps N+1..2N within float32
    summation-order noise of the two-rank run's (the reduction order differs: not bit-equal)."""
    straight, _ = runs
    one = tmp_path / "one"
    shutil.copytree(straight / "checkpoints" / f"step-{N:08d}", one / "checkpoints" / f"step-{N:08d}")
    result = torchrun(_args(tiny_dataset, one, 2 * N, "--checkpoint.async_save=false",
                            f"--train.global_batch={GLOBAL_BATCH}"), nproc=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_jsonl(one / "metrics.jsonl")
    assert any(r["event"] == "resume" and r["step"] == N for r in records)
    resumed = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    two = {r["step"]: r["loss"] for r in read_jsonl(straight / "metrics.jsonl") if r["event"] == "step"}
    assert sorted(resumed) == list(range(N + 1, 2 * N + 1))
    gap = max(abs(resumed[s] - two[s]) for s in resumed)
    assert gap < 2e-3, f"losses differ by {gap}: {resumed} against {two}"


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def test_sigkill_mid_write_keeps_the_previous_checkpoint(runs, tmp_path, tiny_dataset, caplog):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    # Step N committed by an earlier run (the split run's, copied: a restart needs only the checkpoint directory);
    # the final save of this run stalls in its write of step N + 2. (Within one run, a write of an earlier step
    # still in flight at the final save would be cancelled: the final save supersedes it.)
    shutil.copytree(runs[1] / "checkpoints" / f"step-{N:08d}", ckpt / f"step-{N:08d}")
    assert committed_steps(ckpt) == [N]
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "trainer",
           *_args(tiny_dataset, run_dir, N + 2, "--checkpoint.interval=2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", FAULT_ENV: f"slow_write:120@{N + 2}"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (committed_steps(ckpt) == [N] and list(ckpt.glob(f"step-{N + 2:08d}.tmp/*.partial"))):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its last step was written"
            time.sleep(0.2)
        tree = _descendants(proc.pid)
        trainers = _children(proc.pid)
        for pid in trainers:  # SIGKILL the training processes, not their writers: the writers must go by themselves
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (alive := {p for p in tree if Path(f"/proc/{p}").exists() and not _zombie(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"processes left behind: {alive}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    step_dir, manifest = find_valid_checkpoint(ckpt)
    assert step_dir.name == f"step-{N:08d}" and manifest["world_size"] == 2
    assert (ckpt / f"step-{N + 2:08d}.tmp").is_dir()  # the partial save is never taken for a checkpoint
    # A restart (here on one process) ignores and removes the partial one and resumes from step N.
    cfg = load_config("tiny", [*MICRO_MODEL, f"--data.path={tiny_dataset}", f"--train.batch_size={GLOBAL_BATCH}",
                               f"--data.seq_len={SEQ}", f"--checkpoint.dir={ckpt}",
                               f"--checkpoint.node_local_dir={tmp_path / 'node'}"])
    cfg.model.vocab_size = ShardedTokens(tiny_dataset, verify=False).vocab_size
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mgr = CheckpointManager(cfg.checkpoint, ckpt, DistEnv(0, 1, 0, 1), cfg.to_json())
    try:
        mgr.bind()
        model = build_model(cfg, torch.device("cpu"))
        state = {"model": model, "optimizer": build_optimizer(model, cfg.optim), "progress": TrainProgress(),
                 "dataloader": TokenLoader(ShardedTokens(tiny_dataset, verify=False), cfg.data.seq_len, GLOBAL_BATCH, 0, 1, cfg.data.seed)}
        assert mgr.load_latest(state) == N
        assert not (ckpt / f"step-{N + 2:08d}.tmp").exists()
    finally:
        mgr.close()
        dist.destroy_process_group()


def _children(pid: int) -> set[int]:
    return {p for p in _descendants(pid) if _ppid(p) == pid}


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
