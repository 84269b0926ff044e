"""The trainer on 2 gloo ranks starts from a transformers-made Llama (a directory, or a file:// URI through the
node-local cache): each rank reads only its own shards; with lr 0 the first step's loss is transformers' loss on
the same batches and the export gives back every tensor; after a few steps of training the export loads in
transformers with the trainer's evaluation loss. Errors in what the user gave are one line with the right code."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_models import hf_loss, load_hf, make_llama, safetensors_dict
from testlib import REPO, read_jsonl, torchrun
from trainer.data import ShardedTokens, TokenLoader, eval_batches
from trainer.evaluate import evaluate
from trainer.export import main as export_main

pytestmark = pytest.mark.multiprocess

SEQ, BATCH = 48, 4
_READ = re.compile(r"base model weights from (\S+): (\d+) tensors, "
                   r"(\d+) of their bytes read by this rank for its (\d+) owned")


def _train(run_dir, source, dataset, *extra, nproc=2):
    # Synchronous saves unless a test asks for the background writer: what these tests check (the loads, the
    # export, transformers' agreement) is in the checkpoint's bytes, which are the same either way
    # (tests/checkpoint/test_resume.py::test_async_save_equals_sync_save), and a writer process per rank costs
    # ~1.3 s of CPU to start (it imports torch) on the suite's 2 cores.
    args = ["--config", "tiny", f"--model.from_hf={source}", f"--data.path={dataset}", f"--train.run_dir={run_dir}",
            "--checkpoint.interval=0", "--checkpoint.async_save=false", f"--checkpoint.node_local_dir={run_dir}/node",
            f"--data.seq_len={SEQ}", f"--train.batch_size={BATCH}", *extra]
    result = torchrun(args, nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def _reads(run_dir, rank):
    """(bytes read, bytes owned) of each weight load in this rank's log."""
    log = (run_dir / "logs" / f"trainer-rank{rank}.log").read_text()
    return [(int(m.group(3)), int(m.group(4))) for m in _READ.finditer(log)]


def _export(step_dir, out, *extra):
    assert export_main([str(step_dir), str(out), *extra]) == 0
    return out


@pytest.mark.parametrize("flavour, as_uri", [("untied-scaled", False), ("tied", True)])
def test_two_ranks_load_train_export_and_transformers_agree(tmp_path, tiny_dataset, flavour, as_uri):
    base = make_llama(tmp_path / "base", flavour, max_shard_size="100KB" if as_uri else None)
    source = f"file://{base}" if as_uri else str(base)
    cache = tmp_path / "cache"
    total = sum(t.numel() * t.element_size() for name, t in safetensors_dict(base).items()
                if not (flavour == "tied" and name == "lm_head.weight"))

    # lr 0: one step through the whole path, the weights unchanged.
    run = _train(tmp_path / "lr0", source, tiny_dataset, "--train.steps=1", "--optim.lr=0",
                 f"--model.from_hf_cache={cache}")
    (read0, owned0), = _reads(run, 0)
    (read1, owned1), = _reads(run, 1)
    assert owned0 + owned1 == total
    # Each rank reads its own rows; only the q/k heads its shard boundary cuts are read by both (at most one head
    # group per q/k tensor: 2 layers x (q + k) x head_dim 16 x dim 64 x 4 bytes).
    for read, owned in ((read0, owned0), (read1, owned1)):
        assert owned <= read <= owned + 2 * 2 * 16 * 64 * 4 and read < 0.6 * total
    hf = load_hf(base)
    dataset = ShardedTokens(tiny_dataset, verify=False)
    seed = 1234  # data.seed's default
    losses = [hf_loss(hf, *TokenLoader(dataset, SEQ, BATCH, rank, 2, seed).next_batch()) for rank in (0, 1)]
    step1 = next(r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "step")["loss"]
    assert step1 == pytest.approx(sum(losses) / 2, rel=1e-5, abs=1e-5)
    out = _export(run / "checkpoints" / "step-00000001", tmp_path / "export-lr0", "--dtype", "float32")
    original, exported = safetensors_dict(base), safetensors_dict(out)
    if flavour == "tied":
        original.pop("lm_head.weight", None)
    assert exported.keys() == original.keys()
    for name in original:
        assert torch.equal(exported[name], original[name]), name
    if as_uri:  # local rank 0 downloaded, once; rank 1 waited or found the files complete
        (entry,) = [p for p in cache.iterdir() if p.is_dir()]
        assert (entry / ".complete-meta").is_file() and (entry / ".complete-weights").is_file()
        assert "downloading" in (run / "logs" / "trainer-rank0.log").read_text()
        assert "downloading" not in (run / "logs" / "trainer-rank1.log").read_text()

    # A few steps of training, then the export: transformers' loss is the trainer's evaluation loss.
    trained = _train(tmp_path / "trained", source, tiny_dataset, "--train.steps=4", "--optim.lr=3e-3",
                     "--optim.warmup_steps=0", f"--model.from_hf_cache={cache}")
    assert [r["step"] for r in read_jsonl(trained / "metrics.jsonl") if r["event"] == "step"] == [1, 2, 3, 4]
    out = _export(trained / "checkpoints" / "step-00000004", tmp_path / "export", "--dtype", "float32")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == dataset.eos_id
    assert not torch.equal(safetensors_dict(out)["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    ours = evaluate(trained / "checkpoints", tiny_dataset, batch_size=BATCH, max_batches=4, device="cpu")
    val = ShardedTokens(tiny_dataset, split="val", verify=False)
    total_loss, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in eval_batches(val, SEQ, BATCH, 0, 1, 4):
            logits = model(input_ids=inputs).logits
            total_loss += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
    assert ours["step"] == 4 and ours["val_tokens"] == tokens
    assert total_loss / tokens == pytest.approx(ours["val_loss"], rel=1e-5)

    if flavour == "tied":  # the 2-rank checkpoint resumes on 1 rank (resharded) and never reads the base weights
        shutil.rmtree(cache)  # nothing of the base weights is left to read
        _train(trained, source, tiny_dataset, "--train.steps=5", "--optim.lr=3e-3", "--optim.warmup_steps=0",
               f"--model.from_hf_cache={cache}", f"--train.batch_size={2 * BATCH}", nproc=1)
        assert len(_reads(trained, 0)) == 1  # the first run's load only
        assert "restored step 4 from" in (trained / "logs" / "trainer-rank0.log").read_text()
        assert not (next(cache.iterdir()) / ".complete-weights").exists()


def _trainer_cli(tmp_path, source, dataset, *extra):
    return subprocess.run(
        [sys.executable, "-m", "trainer", "--config", "tiny", f"--model.from_hf={source}", f"--data.path={dataset}",
         f"--train.run_dir={tmp_path / 'run'}", f"--checkpoint.node_local_dir={tmp_path / 'node'}",
         "--train.steps=1", *extra],
        capture_output=True, text=True, timeout=180, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _one_line(result, code):
    lines = [line for line in result.stderr.splitlines() if " ERROR [" in line or line.startswith("config error:")]
    assert result.returncode == code and len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


def test_what_the_user_must_change_is_one_line(tmp_path, tiny_dataset):
    other = make_llama(tmp_path / "mistral", "plain")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                   "model_type": "mistral"}))
    line = _one_line(_trainer_cli(tmp_path / "a", other, tiny_dataset), 2)
    assert "MistralForCausalLM" in line and "only Llama-family" in line

    small = make_llama(tmp_path / "small", "plain", vocab=1000)
    line = _one_line(_trainer_cli(tmp_path / "b", small, tiny_dataset), 2)
    assert "vocabulary of 2048 tokens, more than the base model's 1000" in line

    line = _one_line(_trainer_cli(tmp_path / "c", small, tiny_dataset, f"--checkpoint.init_from={tmp_path}"), 2)
    assert "model.from_hf and checkpoint.init_from" in line


def test_a_missing_shard_is_exit_4(tmp_path, tiny_dataset):
    base = make_llama(tmp_path / "base", "plain", max_shard_size="100KB")
    index = json.loads((base / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    (base / victim).unlink()
    line = _one_line(_trainer_cli(tmp_path, base, tiny_dataset), 4)
    assert "CHECKPOINT_ERROR" in line and f"missing: {victim}" in line


def test_resume_from_hf_start_is_bit_exact(tmp_path, tiny_dataset):
    """A tied, RoPE-scaled model started from Hugging Face weights: 4 steps straight and 2 + resumed 2 end with
    bit-identical checkpoints (the resumed run restores its checkpoint, not the base weights)."""
    base = make_llama(tmp_path / "base", "tied")
    constant = ("--optim.warmup_steps=0", "--optim.min_lr_ratio=1.0", "--optim.lr=3e-3")
    straight = _train(tmp_path / "straight", base, tiny_dataset, "--train.steps=4", "--checkpoint.interval=2",
                      "--checkpoint.async_save=true", *constant)  # background writes, against the split's inline ones
    split = _train(tmp_path / "split", base, tiny_dataset, "--train.steps=2", *constant)
    _train(split, base, tiny_dataset, "--train.steps=4", *constant)
    assert len(_reads(split, 0)) == 1  # only the first run read the base weights

    def tensors(run):
        out = {}
        for shard in sorted((run / "checkpoints" / "step-00000004").glob("shard-*.pt")):
            out.update({f"{shard.name}:{k}": v for k, v in torch.load(shard, weights_only=True)["tensors"].items()})
        return out

    a, b = tensors(straight), tensors(split)
    assert a.keys() == b.keys() and any("tok_embeddings" in k for k in a) and not any("output" in k for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
