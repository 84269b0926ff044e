"""``python -m trainer.export``: a checkpoint written by the trainer becomes a directory transformers loads, with
every tensor as trained; bad input is one line with the contract's exit code; a failed export leaves nothing
under the final name."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from hf_models import hf_loss, load_hf, make_llama, safetensors_dict
from trainer.checkpoint import CheckpointManager, step_dir_name
from trainer.config import CheckpointConfig, JobConfig, ModelConfig, TrainConfig
from trainer.export import export, parse_size
from trainer.hf import BaseModel
from trainer.hf.safetensors_out import ShardWriter
from trainer.model import Transformer
from trainer.parallel import DistEnv, apply_fsdp
from trainer.train import TrainProgress, build_optimizer


class _Position:
    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, state: dict) -> None: ...


def _checkpoint(tmp_path, base, dataset) -> "os.PathLike":
    """The base model loaded into the trainer (one rank) and saved as step 1 of a run on ``dataset``: the
    checkpoint an lr-0 run would leave."""
    cfg = JobConfig()
    cfg.model = ModelConfig(from_hf=str(base))
    cfg.data.path, cfg.data.seq_len = str(dataset), 64
    BaseModel.for_model(cfg.model)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mgr = CheckpointManager(CheckpointConfig(node_local_dir=str(tmp_path / "node")), tmp_path / "ckpt",
                            DistEnv(0, 1, 0, 1), config_json=cfg.to_json())
    try:
        mgr.bind()
        model = Transformer(cfg.model, cfg.data.seq_len)
        model.init_weights(0)
        model = apply_fsdp(model, TrainConfig(device="cpu"), torch.device("cpu"))
        BaseModel.open(str(base)).load_into(model)
        state = {"model": model, "optimizer": build_optimizer(model, cfg.optim), "progress": TrainProgress(),
                 "dataloader": _Position()}
        state["progress"].step = 1
        mgr.save(1, state, last_step=True)
    finally:
        mgr.close()
        dist.destroy_process_group()
    return tmp_path / "ckpt" / step_dir_name(1)


@pytest.mark.parametrize("flavour", ["tied", "untied-scaled"])
def test_load_then_export_gives_back_every_tensor(tmp_path, tiny_dataset, flavour):
    base = make_llama(tmp_path / "base", flavour)
    step_dir = _checkpoint(tmp_path, base, tiny_dataset)
    summary = export(step_dir, tmp_path / "out", dtype=torch.float32)
    out = tmp_path / "out"
    assert summary["files"] == 1 and (out / "model.safetensors").is_file()
    original, exported = safetensors_dict(base), safetensors_dict(out)
    if flavour == "tied":
        assert "lm_head.weight" not in exported
        original.pop("lm_head.weight", None)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is (flavour == "tied") and config["eos_token_id"] == 0
    assert config["max_position_embeddings"] == 256  # the base model's, not the run's seq_len
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 0}

    from transformers import AutoTokenizer

    hf, theirs = load_hf(out), load_hf(base)
    tokens = torch.randint(0, 2048, (1, 49), generator=torch.Generator().manual_seed(0))
    assert hf_loss(hf, tokens[:, :-1], tokens[:, 1:]) == hf_loss(theirs, tokens[:, :-1], tokens[:, 1:])
    tokenizer = AutoTokenizer.from_pretrained(out)
    from tokenizers import Tokenizer

    text = "def add(a, b):\n    return a + b\n"
    assert tokenizer(text).input_ids == Tokenizer.from_file(str(tiny_dataset / "tokenizer.json")).encode(text).ids
    assert tokenizer.eos_token_id == 0 and tokenizer.eos_token == "<|endoftext|>"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_bf16_sharded_export_with_index(tmp_path, tiny_dataset):
    base = make_llama(tmp_path / "base", "untied-scaled")
    step_dir = _checkpoint(tmp_path, base, tiny_dataset)
    summary = export(step_dir, tmp_path / "out", dtype=torch.bfloat16, max_shard_bytes=parse_size("100KB"))
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert summary["files"] == len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in safetensors_dict(out).values())
    for name, tensor in safetensors_dict(base).items():
        assert torch.equal(safetensors_dict(out)[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = load_hf(out)  # transformers reads the index and our streamed files
    assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.rope_parameters["factor"] == 8.0
    # An earlier export in the way is replaced; the new one is complete.
    export(step_dir, out, dtype=torch.float32)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_a_failed_export_leaves_nothing_under_the_final_name(tmp_path, tiny_dataset, monkeypatch):
    from trainer.checkpoint import CheckpointError

    step_dir = _checkpoint(tmp_path, make_llama(tmp_path / "base", "tied"), tiny_dataset)
    real_write = ShardWriter.write
    written = []

    def failing(self, name, tensor):
        if written:
            raise OSError(28, "No space left on device")
        written.append(name)
        real_write(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing)
    with pytest.raises(CheckpointError, match="cannot write the export .*No space left on device"):
        export(step_dir, tmp_path / "exports" / "m")
    assert list((tmp_path / "exports").iterdir()) == []
    # A directory left by a killed export (its process is gone) is removed by the next one.
    stale = tmp_path / "exports" / f".m.export-tmp-{2**22 + 12345}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(ShardWriter, "write", real_write)
    export(step_dir, tmp_path / "exports" / "m")
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["m"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.export", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


# Runs `python -m trainer.export ARGS` once per case in ONE process (each case would otherwise pay its own torch
# import): per case the exit code `raise SystemExit(main())` would give (argparse's SystemExit included), and its
# own stdout and stderr, where logging.basicConfig writes anew (root handlers cleared) as in a fresh process.
_CASES_DRIVER = """
import contextlib, io, json, logging, sys
from trainer.export import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    logging.root.handlers.clear()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    logging.root.handlers.clear()
    results.append({"returncode": int(code), "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def _cli_cases(*cases: list[str]) -> list[subprocess.CompletedProcess]:
    done = subprocess.run([sys.executable, "-c", _CASES_DRIVER, json.dumps(cases)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"])
            for argv, r in zip(cases, json.loads(done.stdout.splitlines()[-1]))]


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if "error" in line and "FutureWarning" not in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_cli_exit_codes_and_one_line_errors(tmp_path, tiny_dataset):
    step_dir = _checkpoint(tmp_path, make_llama(tmp_path / "base", "plain"), tiny_dataset)
    ok = _cli(str(step_dir), str(tmp_path / "out"), "--dtype", "float32")  # a process of its own: the real exit
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip().startswith(f"exported step 1 (1 ranks) to {tmp_path / 'out'}")

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    corrupt = tmp_path / "corrupt" / step_dir.name  # a copy with one flipped byte in a shard
    shutil.copytree(step_dir, corrupt)
    shard = next(corrupt.glob("shard-*.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    parent, nowhere, no_data, busy, fp16, bad_shard, help_ = _cli_cases(
        [str(tmp_path / "ckpt"), str(tmp_path / "o2")],
        [str(tmp_path / "nowhere"), str(tmp_path / "o2")],
        [str(step_dir), str(tmp_path / "o2"), "--data", str(tmp_path / "no-data")],
        [str(step_dir), str(tmp_path / "busy")],
        [str(step_dir), str(tmp_path / "o2"), "--dtype", "float16"],
        [str(corrupt), str(tmp_path / "o3")],
        ["--help"])
    assert parent.returncode == 2 and "pass one of them, e.g." in _error_line(parent) and "step-00000001" in parent.stderr
    assert nowhere.returncode == 2 and "is not a directory" in _error_line(nowhere)
    assert no_data.returncode == 2 and "pass --data" in _error_line(no_data)
    assert busy.returncode == 2 and "not an earlier export" in _error_line(busy)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert fp16.returncode == 2 and "invalid choice" in fp16.stderr
    assert bad_shard.returncode == 4 and "checksum-mismatch" in _error_line(bad_shard)
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o2").exists()

    assert help_.returncode == 0
    for words in ("--dtype", "bfloat16", "--data", "Exit codes", "tokenizer", "any world size"):
        assert words in help_.stdout, words
