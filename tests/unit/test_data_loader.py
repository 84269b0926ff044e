"""Trainer side of the token-shard contract (trainer/data.py): reader checks, training and eval loaders."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from components.lib import tokendata
from testlib import write_token_shards
from trainer import data
from trainer.data import ShardError, ShardedTokens, TokenLoader, eval_batches


@pytest.fixture
def synthetic(tmp_path: Path) -> ShardedTokens:
    """Two shards, seq_len 4: (41 - 1) // 4 = 10 and (30 - 1) // 4 = 7 samples, 17 in all."""
    return ShardedTokens(write_token_shards(tmp_path / "syn", [41, 30]))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dataset from the builder: small corpus, several shards."""
    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(10):
        body = "".join(f"def f_{i}_{j}(x):\n    return x + {i * j}  # ünïcode ✓\n" for j in range(20 + i))
        (corpus / f"m{i}.py").write_text(body, encoding="utf-8")
    out = tmp_path_factory.mktemp("ds")
    tokendata.build_dataset(corpus, out, vocab_size=300, val_fraction=0.2, shard_tokens=800)
    return out


@pytest.fixture
def copy_of_built(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built dataset that a test may corrupt."""
    return Path(shutil.copytree(built, tmp_path / "ds"))


def _edit_manifest(root: Path, **changes: object) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(changes)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _first_tokens(batch: torch.Tensor) -> list[int]:
    """Sample identities in a synthetic batch (first input token of each row)."""
    return batch[:, 0].tolist()


# ---------------------------------------------------------------- reader


def test_reader_matches_builder_output(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(built / "tokenizer.json"))
    for split in ("train", "val"):
        tokens = ShardedTokens(built, split)
        assert (tokens.vocab_size, tokens.eos_id, tokens.dtype) == (manifest["vocab_size"], manifest["eos_id"], "uint16")
        assert tokens.num_tokens == manifest["num_tokens"][split] == sum(len(s) for s in tokens.shards)
        assert tokens.manifest == manifest
        assert len(tokens.shards) == len(manifest["splits"][split])
        text = tokenizer.decode(np.concatenate(tokens.shards).tolist())
        assert "def f_" in text and "ünïcode ✓" in text
    assert len(ShardedTokens(built, "train").shards) > 1


def test_format_constants_agree_between_writer_and_reader() -> None:
    assert data.FORMAT == tokendata.FORMAT
    assert tokendata.FORMAT_VERSION in data.SUPPORTED_VERSIONS
    assert data.MANIFEST == tokendata.MANIFEST


def test_reader_module_imports_no_nvrx_or_components() -> None:
    tree = ast.parse(Path(data.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"components", "nvidia_resiliency_ext"}


def test_flipped_byte_is_caught_by_checksum(copy_of_built: Path) -> None:
    shard = copy_of_built / "train-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"train-00001\.bin is corrupt: its sha256.*re-run data prep"):
        ShardedTokens(copy_of_built, "train")
    assert len(ShardedTokens(copy_of_built, "train", verify=False).shards) > 1, "verify=False skips hashing"


def test_truncated_shard_is_caught_even_without_verify(copy_of_built: Path) -> None:
    shard = copy_of_built / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ShardError, match=r"train-00000\.bin has \d+ bytes.*truncated"):
        ShardedTokens(copy_of_built, "train", verify=False)


def test_manifest_dtype_mismatch(copy_of_built: Path) -> None:
    _edit_manifest(copy_of_built, dtype="uint32")
    with pytest.raises(ShardError, match=r"manifest\.json: dtype uint32 does not match vocab_size"):
        ShardedTokens(copy_of_built)


def test_uint32_manifest_over_uint16_shards(copy_of_built: Path) -> None:
    """A self-consistent uint32 manifest whose shards were written as uint16: caught by the size check."""
    manifest = json.loads((copy_of_built / "manifest.json").read_text())
    for entry in manifest["splits"]["train"]:
        entry["num_bytes"] = entry["num_tokens"] * 4
    _edit_manifest(copy_of_built, dtype="uint32", vocab_size=70000, splits=manifest["splits"])
    with pytest.raises(ShardError, match=r"train-00000\.bin .*uint32.*another dtype"):
        ShardedTokens(copy_of_built)


def test_token_ids_beyond_vocab_are_caught(copy_of_built: Path) -> None:
    _edit_manifest(copy_of_built, vocab_size=50)
    with pytest.raises(ShardError, match=r"train-00000\.bin holds token id \d+ >= vocab_size 50"):
        ShardedTokens(copy_of_built)


def test_missing_shard(copy_of_built: Path) -> None:
    (copy_of_built / "val-00000.bin").unlink()
    with pytest.raises(ShardError, match=r"shard .*val-00000\.bin is missing"):
        ShardedTokens(copy_of_built, "val")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 2}, r"format version 2 is not supported"),
        ({"format": "something-else"}, r"format 'something-else' is not"),
        ({"dtype": "int8"}, r"dtype 'int8' is not one of"),
        ({"eos_id": 10**6}, r"eos_id 1000000 >= vocab_size"),
        ({"num_tokens": {"train": 1, "val": 1}}, r"num_tokens.train is 1 but its shards hold"),
    ],
)
def test_bad_manifest_fields(copy_of_built: Path, changes: dict, message: str) -> None:
    _edit_manifest(copy_of_built, **changes)
    with pytest.raises(ShardError, match=r"manifest\.json: " + message):
        ShardedTokens(copy_of_built)


def test_missing_manifest_corrupt_tokenizer_and_unknown_split(copy_of_built: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"manifest\.json not found.*re-run data prep"):
        ShardedTokens(tmp_path / "nothing-here")
    with pytest.raises(ShardError, match=r"no shards listed for split 'test' \(splits: \['train', 'val'\]\)"):
        ShardedTokens(copy_of_built, "test")
    (copy_of_built / "tokenizer.json").write_text("{}")
    with pytest.raises(ShardError, match=r"tokenizer\.json is corrupt"):
        ShardedTokens(copy_of_built)


# ---------------------------------------------------------------- samples and training loader


def test_samples_are_windows_inside_one_shard(synthetic: ShardedTokens) -> None:
    assert synthetic.num_samples(4) == 17
    windows = synthetic.samples(np.arange(17), 4)
    expected = [np.arange(i * 4, i * 4 + 5) for i in range(10)] + [41 + np.arange(i * 4, i * 4 + 5) for i in range(7)]
    np.testing.assert_array_equal(windows, np.stack(expected))
    with pytest.raises(IndexError):
        synthetic.samples([17], 4)


def test_batches_are_shifted_int64_pairs(synthetic: ShardedTokens) -> None:
    inputs, targets = TokenLoader(synthetic, seq_len=4, batch_size=3, rank=0, world_size=1, seed=0).next_batch()
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (3, 4)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(targets[:, -1], inputs[:, -1] + 1)


def test_same_seed_same_batches_other_seed_differs(synthetic: ShardedTokens) -> None:
    def run(seed: int) -> list[list[int]]:
        loader = TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=1, seed=seed)
        return [_first_tokens(next(loader)[0]) for _ in range(6)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_ranks_split_the_global_batch(synthetic: ShardedTokens) -> None:
    single = TokenLoader(synthetic, seq_len=4, batch_size=4, rank=0, world_size=1, seed=3)
    ranks = [TokenLoader(synthetic, seq_len=4, batch_size=2, rank=r, world_size=2, seed=3) for r in range(2)]
    for _ in range(10):  # crosses several epochs (4 global batches of 4 per 17-sample epoch)
        parts = [loader.next_batch() for loader in ranks]
        a, b = _first_tokens(parts[0][0]), _first_tokens(parts[1][0])
        assert not set(a) & set(b), "ranks get disjoint samples"
        inputs, targets = single.next_batch()
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)


def test_epoch_rollover_drops_the_tail_and_reshuffles(synthetic: ShardedTokens) -> None:
    loader = TokenLoader(synthetic, seq_len=4, batch_size=5, rank=0, world_size=1, seed=11)
    starts = {k: int(synthetic.samples([k], 4)[0, 0]) for k in range(17)}
    for epoch in range(3):
        seen = [t for _ in range(3) for t in _first_tokens(loader.next_batch()[0])]  # 3 batches of 5, 2 dropped
        assert loader.epoch == epoch
        perm = np.random.default_rng([11, epoch]).permutation(17)
        assert seen == [starts[int(k)] for k in perm[:15]]
        assert len(set(seen)) == 15
    assert loader.state_dict()["position"] == 15


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_continues_with_the_same_batches(synthetic: ShardedTokens, world_size: int) -> None:
    def make(rank: int) -> TokenLoader:
        return TokenLoader(synthetic, seq_len=4, batch_size=2, rank=rank, world_size=world_size, seed=5)

    loaders = [make(r) for r in range(world_size)]
    for _ in range(5):  # into the second epoch (4 global batches of 4 per epoch for world_size 2)
        for loader in loaders:
            loader.next_batch()
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    assert all(s == states[0] for s in states), "the state is global, identical on every rank"
    for rank, loader in enumerate(loaders):
        resumed = make(rank)
        resumed.load_state_dict(states[0])
        for _ in range(4):
            expected, got = loader.next_batch(), resumed.next_batch()
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_resume_two_ranks_into_one_rank_with_doubled_batch(synthetic: ShardedTokens) -> None:
    ranks = [TokenLoader(synthetic, seq_len=4, batch_size=2, rank=r, world_size=2, seed=9) for r in range(2)]
    for _ in range(3):
        for loader in ranks:
            loader.next_batch()
    single = TokenLoader(synthetic, seq_len=4, batch_size=4, rank=0, world_size=1, seed=9)
    single.load_state_dict(ranks[0].state_dict())
    for _ in range(3):
        inputs, _ = single.next_batch()
        assert torch.equal(inputs, torch.cat([loader.next_batch()[0] for loader in ranks]))


def test_load_state_dict_rejects_mismatches(synthetic: ShardedTokens, tmp_path: Path) -> None:
    state = TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="set seq_len=4"):
        TokenLoader(synthetic, seq_len=3, batch_size=2, rank=0, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="set the data seed to 1"):
        TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"global batch size 4 .*set batch_size=1"):
        TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        TokenLoader(synthetic, seq_len=4, batch_size=1, rank=0, world_size=3, seed=1).load_state_dict(state)
    other = ShardedTokens(write_token_shards(tmp_path / "other", [41]))
    with pytest.raises(ValueError, match="resume with the same dataset"):
        TokenLoader(other, seq_len=4, batch_size=2, rank=0, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=2, seed=1).load_state_dict({"epoch": 0})


def test_too_small_dataset_says_how_many_tokens(synthetic: ShardedTokens) -> None:
    with pytest.raises(ValueError, match=r"17 samples .* needs 20 samples \(at least 81 tokens in one shard\)"):
        TokenLoader(synthetic, seq_len=4, batch_size=10, rank=0, world_size=2, seed=0)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        TokenLoader(synthetic, seq_len=4, batch_size=1, rank=2, world_size=2, seed=0)


def test_loader_on_built_dataset(built: Path) -> None:
    tokens = ShardedTokens(built, "train")
    inputs, targets = TokenLoader(tokens, seq_len=16, batch_size=4, rank=0, world_size=1, seed=0).next_batch()
    assert inputs.shape == (4, 16) and int(targets.max()) < tokens.vocab_size
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


# ---------------------------------------------------------------- eval batches


@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 4), (2, 2), (3, 1)])
def test_eval_batches_cover_each_sample_once(synthetic: ShardedTokens, world_size: int, batch_size: int) -> None:
    per_rank = [list(eval_batches(synthetic, 4, batch_size, rank, world_size)) for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1, "every rank runs the same number of batches"
    seen = [t for batches in per_rank for inputs, _ in batches for t in _first_tokens(inputs)]
    usable = 17 // (world_size * batch_size) * world_size * batch_size
    assert len(seen) == len(set(seen)) == usable
    assert sorted(seen) == [int(synthetic.samples([k], 4)[0, 0]) for k in range(usable)]
    again = [t for inputs, _ in eval_batches(synthetic, 4, batch_size, 0, world_size) for t in _first_tokens(inputs)]
    assert again == [t for inputs, _ in per_rank[0] for t in _first_tokens(inputs)], "deterministic"


def test_eval_batches_max_batches_and_errors(synthetic: ShardedTokens) -> None:
    assert len(list(eval_batches(synthetic, 4, 2, 0, 1, max_batches=3))) == 3
    with pytest.raises(ValueError, match="max_batches=0"):
        eval_batches(synthetic, 4, 2, 0, 1, max_batches=0)
    with pytest.raises(ValueError, match="at least 73 tokens in one shard"):
        eval_batches(synthetic, 4, 6, 0, 3)


def test_dataset_is_hashed_once_per_job_and_a_file_changed_since_again(tmp_path: Path, monkeypatch) -> None:
    """A restarted worker skips the files verified earlier in the job (the marker in the run directory), but a
    shard rewritten since (another size, mtime or inode) is hashed again, and corrupt is still a ShardError."""
    root = write_token_shards(tmp_path / "syn", [41, 30])
    marker = tmp_path / "run" / data.VERIFIED_FILE
    scanned: list[str] = []
    real_scan = data._scan_file
    monkeypatch.setattr(data, "_scan_file", lambda path, dtype: scanned.append(path.name) or real_scan(path, dtype))

    ShardedTokens(root, verified=marker)
    assert scanned == ["train-00000.bin", "train-00001.bin"] and marker.is_file()
    ShardedTokens(root, verified=marker)
    assert scanned == ["train-00000.bin", "train-00001.bin"], "the second start hashes nothing"

    shard = root / "train-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01
    shard.with_name("new").write_bytes(bytes(raw))
    shard.with_name("new").replace(shard)  # corrupt and replaced (same size): a new inode
    with pytest.raises(ShardError, match=r"train-00001\.bin is corrupt: its sha256"):
        ShardedTokens(root, verified=marker)
    assert scanned[2:] == ["train-00001.bin"], "only the changed shard is hashed again"


def test_a_changed_manifest_is_verified_in_full(tmp_path: Path, monkeypatch) -> None:
    root = write_token_shards(tmp_path / "syn", [41, 30])
    marker = tmp_path / data.VERIFIED_FILE
    ShardedTokens(root, verified=marker)
    _edit_manifest(root, vocab_size=50)  # the same files under another manifest: token ids now out of range
    with pytest.raises(ShardError, match=r"train-00001\.bin holds token id 70 >= vocab_size 50"):
        ShardedTokens(root, verified=marker)
    marker.write_text("not json")  # unreadable: verified again, not an error
    _edit_manifest(root, vocab_size=65536)
    assert len(ShardedTokens(root, verified=marker).shards) == 2
    assert json.loads(marker.read_text())["files"].keys() == {"tokenizer.json", "train-00000.bin", "train-00001.bin"}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_world_size_consumes_the_same_samples_each_step_with_a_fixed_global_batch(
        synthetic: ShardedTokens, world_size: int) -> None:
    """``train.global_batch`` = 8 with micro-batches of 2: one rank accumulates 4, two ranks 2 each, four ranks 1:
    each step consumes the same 8 samples of the global order (across epochs), so a run resumed on another world
    size trains on exactly the samples the first would have."""
    accumulation = 8 // (2 * world_size)
    loaders = [TokenLoader(synthetic, seq_len=4, batch_size=2, rank=r, world_size=world_size, seed=4,
                           accumulation=accumulation) for r in range(world_size)]
    reference = TokenLoader(synthetic, seq_len=4, batch_size=8, rank=0, world_size=1, seed=4)
    for loader in [*loaders, reference]:  # data.sample_log's record: the sample numbers each rank served
        loader.served = []
    for _ in range(5):  # 2 global batches of 8 per 17-sample epoch: crosses two epochs
        step = [t for loader in loaders for _ in range(accumulation) for t in _first_tokens(loader.next_batch()[0])]
        assert sorted(step) == sorted(_first_tokens(reference.next_batch()[0]))
        assert all(loader.state_dict() == reference.state_dict() for loader in loaders)
        served = [loader.take_served() for loader in loaders]
        expected = reference.take_served()
        assert sorted(i for s in served for i in s["samples"]) == sorted(expected["samples"])
        assert len(expected["samples"]) == 8 and {s["epoch"] for s in served} == {expected["epoch"]}
    assert TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=1, seed=4).served is None  # not asked


def test_a_resume_on_fewer_ranks_accumulates_to_the_same_global_batch(synthetic: ShardedTokens) -> None:
    state = TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"global batch size 4 .*set train.global_batch=4 to resume"):
        TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=1, seed=1).load_state_dict(state)
    TokenLoader(synthetic, seq_len=4, batch_size=2, rank=0, world_size=1, seed=1, accumulation=2).load_state_dict(state)
