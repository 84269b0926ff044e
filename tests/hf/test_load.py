"""``model.from_hf`` in one process (gloo, world size 1): weights of a transformers-made Llama load into the
FSDP2-sharded trainer model and give transformers' logits; bad sources fail with one line; URIs go through the
node-local cache; a tied model survives our checkpoint save and restore under one name."""

import json
import shutil

import fsspec
import pytest
import torch
import torch.distributed as dist

from hf_models import VOCAB, hf_loss, load_hf, make_llama
from trainer.checkpoint import CheckpointError, CheckpointManager, committed_steps, load_model_weights, step_dir_name
from trainer.config import CheckpointConfig, ConfigError, ModelConfig, OptimConfig, TrainConfig
from trainer.hf import BaseModel, BaseModelFilesError
from trainer.hf.source import Fetcher
from trainer.model import Transformer
from trainer.parallel import DistEnv, apply_fsdp
from trainer.train import TrainProgress, build_optimizer

SEQ = 48  # longer than the test models' original RoPE context (32): the llama3 scaling matters


@pytest.fixture
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _loaded(source: str, **cfg_kw) -> tuple[torch.nn.Module, ModelConfig, dict]:
    cfg = ModelConfig(from_hf=source, **cfg_kw)
    base = BaseModel.for_model(cfg)
    model = Transformer(cfg, SEQ)
    model.init_weights(0)
    model = apply_fsdp(model, TrainConfig(device="cpu"), torch.device("cpu"))
    return model, cfg, base.load_into(model)


@pytest.mark.parametrize("flavour", ["untied-scaled", "tied", "plain"])
def test_loaded_model_computes_what_transformers_computes(tmp_path, pg, flavour):
    base = make_llama(tmp_path / "base", flavour)
    model, cfg, stats = _loaded(str(base))
    assert cfg.tie_embeddings == (flavour == "tied") and cfg.name == "base" and cfg.vocab_size == VOCAB
    assert stats["bytes_read"] == stats["bytes_owned"]  # one rank owns everything, and reads nothing twice
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    hf = load_hf(base)
    with torch.no_grad():
        ours = model(tokens[:, :-1])
        theirs = hf(input_ids=tokens[:, :-1]).logits
        loss = model(tokens[:, :-1], tokens[:, 1:]).item()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert loss == pytest.approx(hf_loss(hf, tokens[:, :-1], tokens[:, 1:]), rel=1e-5)
    assert loss > 8.0, "random weights drawn wide: the loss is far from uniform's (a wrong mapping shows)"


def test_sharded_bf16_checkpoint_loads_exactly(tmp_path, pg):
    """Shards with an index (a 40 KB limit gives several files) in bfloat16: each parameter equals the stored
    bf16 value exactly, upcast to the trainer's fp32."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from hf_models import safetensors_dict
    from trainer.hf.adapter import LlamaAdapter

    base = make_llama(tmp_path / "base", "untied-scaled", max_shard_size="40KB", save_dtype=torch.bfloat16)
    hf = load_hf(base)
    assert len(list(base.glob("*.safetensors"))) > 2 and (base / "model.safetensors.index.json").is_file()
    stored = safetensors_dict(base)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model, cfg, _ = _loaded(str(base))
    adapter = LlamaAdapter(cfg)
    for fqn, value in get_model_state_dict(model).items():
        name, exported = adapter.to_hf(fqn, value.full_tensor())
        assert exported.dtype == torch.float32 and torch.equal(exported, stored[name].float()), fqn
    with torch.no_grad():
        ours = model(torch.arange(SEQ).unsqueeze(0))
        theirs = hf(input_ids=torch.arange(SEQ).unsqueeze(0)).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_missing_shard_key_and_shape_are_file_errors(tmp_path, pg):
    base = make_llama(tmp_path / "base", "plain", max_shard_size="100KB")
    index = json.loads((base / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (base / victim).rename(tmp_path / victim)
    with pytest.raises(BaseModelFilesError, match=f"missing: {victim}"):
        _loaded(str(base))
    (tmp_path / victim).rename(base / victim)
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BaseModelFilesError, match="no tensor 'model.layers.1.mlp.up_proj.weight'") as err:
        _loaded(str(base))
    _one_line(err.value)

    other = make_llama(tmp_path / "other", "plain")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(BaseModelFilesError, match=r"shape \[96, 64\] in the safetensors files but \[128, 64\]"):
        _loaded(str(other))
    from safetensors.torch import load_file, save_file

    (other / "config.json").write_text(json.dumps(config))
    weights = load_file(other / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.int8)
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="q_proj.weight is stored as I8: a quantized checkpoint"):
        _loaded(str(other))
    (other / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    with pytest.raises(BaseModelFilesError, match="not a readable safetensors file"):
        _loaded(str(other))


def test_not_a_model_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        BaseModel.open(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="has no config.json"):
        BaseModel.open(str(tmp_path))
    base = make_llama(tmp_path / "base", "plain")
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    with pytest.raises(BaseModelFilesError, match="pytorch_model.bin: convert them to safetensors"):
        BaseModel.open(str(base)).load_into(None)


def test_dataset_vocabulary_and_tokenizer_must_match_the_base_model(tmp_path, tiny_dataset):
    small = BaseModel.open(str(make_llama(tmp_path / "small", "plain", vocab=1000)))
    with pytest.raises(ConfigError, match=r"vocabulary of 2048 tokens, more than the base model's 1000") as err:
        small.check_data(tiny_dataset, 2048, 1000, "tokenizer.json")
    assert "--tokenizer" in _one_line(err.value)

    base_dir = make_llama(tmp_path / "base", "plain")
    base = BaseModel.open(str(base_dir))
    base.check_data(tiny_dataset, 2048, VOCAB, "tokenizer.json")  # no tokenizer.json in the base: nothing to compare
    shutil.copy(tiny_dataset / "tokenizer.json", base_dir / "tokenizer.json")
    base.check_data(tiny_dataset, 2048, VOCAB, "tokenizer.json")  # the same tokenizer
    tokenizer = json.loads((tiny_dataset / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer with the same size
    (base_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="tokenized with another tokenizer than the base model's") as err:
        base.check_data(tiny_dataset, 2048, VOCAB, "tokenizer.json")
    assert "2 of the dataset's" in _one_line(err.value)


# ---- URIs: the node-local cache ---------------------------------------------------------------------------------
def _to_memory(local, prefix: str) -> str:
    fs = fsspec.filesystem("memory")
    for path in local.iterdir():
        fs.pipe(f"{prefix}/{path.name}", path.read_bytes())
    return f"memory://{prefix}"


def test_uri_downloads_config_first_and_weights_only_when_read(tmp_path, pg, monkeypatch):
    uri = _to_memory(make_llama(tmp_path / "base", "tied", max_shard_size="100KB"), "/models/tiny-llama")
    cache = tmp_path / "cache"
    calls: list[str] = []
    memory = type(fsspec.filesystem("memory"))
    real_get = memory.get_file
    monkeypatch.setattr(memory, "get_file", lambda self, rpath, lpath, **kw: (calls.append(rpath.rsplit("/", 1)[-1]),
                                                                              real_get(self, rpath, lpath, **kw))[1])
    cfg = ModelConfig(from_hf=uri, from_hf_cache=str(cache))
    base = BaseModel.for_model(cfg)
    assert cfg.name == "tiny-llama" and base.dir.parent == cache
    assert sorted(calls) == ["config.json", "generation_config.json", "model.safetensors.index.json"]
    assert json.loads((base.dir / ".complete-meta").read_text())["uri"] == uri

    model = Transformer(cfg, SEQ)
    model.init_weights(0)
    model = apply_fsdp(model, TrainConfig(device="cpu"), torch.device("cpu"))
    base.load_into(model)
    shards = sorted(c for c in calls if c.endswith(".safetensors"))
    assert len(shards) >= 2 and (base.dir / ".complete-weights").is_file()
    with torch.no_grad():
        torch.testing.assert_close(model(torch.arange(SEQ).unsqueeze(0)),
                                   load_hf(tmp_path / "base")(input_ids=torch.arange(SEQ).unsqueeze(0)).logits,
                                   rtol=1e-4, atol=1e-4)
    calls.clear()
    again = BaseModel.for_model(ModelConfig(from_hf=uri, from_hf_cache=str(cache)))  # a restart on the node
    again.fetch_weights()
    assert calls == [] and again.dir == base.dir


def test_uri_errors_and_waiting_local_ranks(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="cannot be listed.*check the URI and the credentials"):
        BaseModel.open("memory://no/such/model", cache=str(cache))
    uri = _to_memory(make_llama(tmp_path / "base", "plain"), "/models/broken")
    fsspec.filesystem("memory").rm("/models/broken/model.safetensors")
    base = BaseModel.open(uri, cache=str(cache))
    with pytest.raises(BaseModelFilesError, match="lacks model.safetensors"):
        base.fetch_weights()
    failed = base.dir / ".failed-weights"
    assert failed.is_file() and not (base.dir / ".complete-weights").exists()
    # Another local rank of the same attempt waiting for the weights gets rank 0's error, not a hang.
    waiting = Fetcher(uri, cache, local_rank=1)
    with pytest.raises(BaseModelFilesError, match="lacks model.safetensors"):
        waiting.fetch("weights", ["model.safetensors"])
    # A later attempt (another launcher restart) retries instead of repeating an old failure.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fsspec.filesystem("memory").pipe("/models/broken/model.safetensors",
                                     (tmp_path / "base" / "model.safetensors").read_bytes())
    BaseModel.open(uri, cache=str(cache)).fetch_weights()
    assert (base.dir / ".complete-weights").is_file() and not failed.exists()


def test_hub_and_bucket_uris_dispatch_to_their_filesystems(tmp_path):
    """hf:// and s3:// go through the same fsspec path as memory:// and file:// (no network here: only the
    dispatch is checked; neither was exercised against the real services)."""
    from huggingface_hub import HfFileSystem
    from s3fs import S3FileSystem

    fs, root = fsspec.core.url_to_fs("hf://meta-llama/Llama-3.2-1B@main")
    assert isinstance(fs, HfFileSystem) and root == "meta-llama/Llama-3.2-1B@main"
    fs, root = fsspec.core.url_to_fs("s3://models/llama-3.2-1b")
    assert isinstance(fs, S3FileSystem) and root == "models/llama-3.2-1b"
    fetcher = Fetcher("hf://meta-llama/Llama-3.2-1B@main", tmp_path, local_rank=0)
    assert fetcher.dir.parent == tmp_path and fetcher.dir.name.startswith("Llama-3.2-1B-main-")
    assert BaseModel.name.fget(type("S", (), {"source": "hf://meta-llama/Llama-3.2-1B@main"})()) == "Llama-3.2-1B"


def test_credentials_never_reach_messages():
    from trainer.hf.source import redact

    assert redact("s3://AKIA:s3cr3t@bucket/llama?X-Amz-Signature=abc") == "s3://bucket/llama"
    assert redact("hf://meta-llama/Llama-3.2-1B@main") == "hf://meta-llama/Llama-3.2-1B@main"
    assert redact("/models/llama") == "/models/llama"


# ---- a tied model through our checkpoints ------------------------------------------------------------------------
def test_tied_weight_is_one_tensor_in_checkpoints_and_restores(tmp_path, pg):
    base = make_llama(tmp_path / "base", "tied")
    model, cfg, _ = _loaded(str(base))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0))
    state = {"model": model, "optimizer": optimizer, "progress": TrainProgress(), "dataloader": _Position()}
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    state["progress"].step = 1
    ckpt_cfg = CheckpointConfig(interval=1, node_local_dir=str(tmp_path / "node"))
    mgr = CheckpointManager(ckpt_cfg, tmp_path / "ckpt", DistEnv(0, 1, 0, 1), config_json="{}")
    try:
        mgr.bind()
        mgr.save(1, state, last_step=True)
        manifest = json.loads((tmp_path / "ckpt" / step_dir_name(1) / "manifest.json").read_text())
        model_keys = [k for k in manifest["tensors"] if k.startswith("model/")]
        assert "model/tok_embeddings.weight" in model_keys and not any("output" in k for k in model_keys)
        assert "optim/tok_embeddings.weight/exp_avg" in manifest["tensors"]
        with torch.no_grad():
            expected = model(tokens[:, :-1])
        fresh, _, _ = _loaded(str(base))  # the base weights again, then the checkpoint over them
        fresh_state = {"model": fresh, "optimizer": build_optimizer(fresh, OptimConfig()),
                       "progress": TrainProgress(), "dataloader": _Position()}
        for slot in mgr.snapshots.slots:  # as on a new node: only the persistent tier
            mgr.snapshots.drop(slot)
        assert mgr.load_latest(fresh_state) == 1 and mgr.restored_from == "disk"
        with torch.no_grad():
            assert torch.equal(fresh(tokens[:, :-1]), expected)
    finally:
        mgr.close()
    weights = load_model_weights(tmp_path / "ckpt")  # any world size, one process: one name for the tied weight
    plain = Transformer(cfg, SEQ)
    plain.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens[:, :-1]), expected, rtol=1e-5, atol=1e-5)
    assert committed_steps(tmp_path / "ckpt") == [1]
    with pytest.raises(CheckpointError):
        load_model_weights(tmp_path / "nothing")


class _Position:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
