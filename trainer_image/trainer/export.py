"""``python -m trainer.export <checkpoint step dir> <out dir> [--dtype bfloat16|float32]``: one committed checkpoint
as a Hugging Face ``LlamaForCausalLM`` directory that ``transformers``, vLLM and KServe's Hugging Face runtime load.

Written: the model weights only (no optimizer) as safetensors, sharded at 5 GB with ``model.safetensors.index.json``
when there is more than one file; ``config.json`` (``architectures: ["LlamaForCausalLM"]``, the shape, RoPE
settings, BOS/EOS ids, ``torch_dtype``); ``generation_config.json``; and the tokenizer files of the dataset the
checkpoint was trained on (the dataset directory is the checkpoint's ``data.path``, or ``--data``): tokenizer.json,
tokenizer_config.json (written from the dataset manifest's EOS token for datasets built without one) and
special_tokens_map.json when present.

It runs on CPU, without a process group, from a checkpoint of any world size: each tensor is assembled from the
ranks' pieces (``checkpoint/layout.py``), converted and written, one at a time, so memory stays at about one
tensor. Every shard file's checksums are verified first (a thread pool; the reads then come from the page cache).
The directory is written under a temporary name beside ``<out dir>`` and renamed at the end: a killed export
leaves nothing under the final name. An existing ``<out dir>`` that holds an earlier export is replaced.

Exit codes: 0 written (one line on stdout names the directory); 2 bad arguments, not a checkpoint step directory,
or no dataset tokenizer to ship (pass ``--data``); 4 unreadable or corrupt checkpoint files, or the output
cannot be written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import reaper
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import (
    MODEL_PREFIX, Piece, Shards, committed_steps, probe_loadable, read_manifest, verify_shards,
)
from trainer.checkpoint.writer import fsync_dir
from trainer.config import JobConfig
from trainer.config_checks import ConfigError
from trainer.exitcodes import ExitCode
from trainer.hf.adapter import LlamaAdapter, hf_config
from trainer.hf.safetensors_out import INDEX, MAX_SHARD_BYTES, Entry, ShardWriter, index_json, plan_shards

log = logging.getLogger("trainer.export")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Copied from the dataset directory when present, beside its tokenizer file (``tokenizer.json``)."""
_TMP_INFIX = ".export-tmp-"
_REMAP_BYTES = 2**30


def export(step_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
           data_dir: str | Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write the checkpoint in ``step_dir`` as a Hugging Face directory ``out_dir``; returns a summary.
    ``ConfigError``: what the caller must change; ``CheckpointError``: unreadable checkpoint or output."""
    started = time.perf_counter()
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    manifest = _manifest(step_dir)
    try:
        cfg = JobConfig.from_dict(manifest["config"], source=f"{step_dir}/manifest.json (stored config)")
    except (ConfigError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{step_dir}/manifest.json: its stored config cannot be read by this trainer ({exc})") from None
    tokenizer = _Tokenizer(Path(data_dir or cfg.data.path), given=data_dir is not None)
    _check_out(out_dir)
    adapter = LlamaAdapter(cfg.model)
    entries = _entries(step_dir, manifest, adapter, dtype)
    problems = (verify_shards(step_dir, manifest, range(len(manifest["shards"])), checksums=True)
                or probe_loadable(step_dir, manifest, range(len(manifest["shards"]))))
    if problems:
        raise CheckpointError(f"{step_dir} is corrupt ({problems[0][0]}: {problems[0][1]}"
                              f"{f'; and {len(problems) - 1} more problems' if len(problems) > 1 else ''}); "
                              "export another step")
    tmp = out_dir.with_name(f".{out_dir.name}{_TMP_INFIX}{os.getpid()}")
    _remove_stale_tmp(out_dir)
    try:
        tmp.mkdir(parents=True)
        plan = plan_shards([entry for entry, _ in entries], max_shard_bytes)
        _write_weights(tmp, step_dir, manifest, adapter, dict((e.name, fqn) for e, fqn in entries), plan)
        if len(plan) > 1:
            _write_json(tmp / INDEX, index_json(plan))
        bos, eos = tokenizer.special_ids()
        _write_json(tmp / "config.json", hf_config(cfg.model, cfg.data.seq_len, dtype, bos, eos))
        _write_json(tmp / "generation_config.json",
                    {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None})
        tokenizer.write(tmp, cfg.model.max_position_embeddings or cfg.data.seq_len)
        _publish(tmp, out_dir)
    except OSError as exc:
        raise CheckpointError(f"cannot write the export to {out_dir.parent} ({exc.strerror or exc}); free space or "
                              "choose another output directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(e.nbytes for e, _ in entries)
    return {"out_dir": str(out_dir), "step": int(manifest["step"]), "files": len(plan), "bytes": total,
            "dtype": str(dtype).removeprefix("torch."), "world_size": int(manifest["world_size"]),
            "export_time_s": round(time.perf_counter() - started, 3)}


def _manifest(step_dir: Path) -> dict[str, Any]:
    if not step_dir.is_dir():
        raise ConfigError(
            f"{step_dir} is not a directory; pass one committed checkpoint, e.g. <run>/checkpoints/step-00000100")
    manifest, reason, message = read_manifest(step_dir)
    if manifest is not None:
        return manifest
    if reason == "missing-manifest":
        steps = committed_steps(step_dir)
        hint = (f"; it holds committed checkpoints: pass one of them, e.g. {step_dir / f'step-{steps[-1]:08d}'}"
                if steps else "; pass a committed step-XXXXXXXX directory of a run's checkpoints")
        raise ConfigError(f"{step_dir} is not a checkpoint step directory (no manifest.json){hint}")
    raise CheckpointError(f"{step_dir}: {message}")


def _check_out(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir.is_dir() and (not any(out_dir.iterdir()) or _is_export(out_dir))):
        raise ConfigError(f"{out_dir} exists and is not an earlier export (config.json + safetensors); choose an "
                          "empty or new output directory")


def _is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _entries(step_dir: Path, manifest: dict[str, Any], adapter: LlamaAdapter,
             dtype: torch.dtype) -> list[tuple[Entry, str]]:
    """(safetensors entry, our FQN) of every model tensor, in Hugging Face order; the manifest must hold exactly
    the model's tensors."""
    stored = {k[len(MODEL_PREFIX):] for k in manifest["tensors"] if k.startswith(MODEL_PREFIX)}
    expected = adapter.fqns
    if stored != set(expected):
        odd = sorted(stored ^ set(expected))
        raise CheckpointError(f"{step_dir}: its model tensors do not match its stored model config ({len(odd)} differ, "
                              f"e.g. {odd[:3]}); the checkpoint is damaged or from another trainer version")
    return [(Entry(adapter.hf_name(fqn), tuple(manifest["tensors"][MODEL_PREFIX + fqn]["global_shape"]), dtype), fqn)
            for fqn in expected]


def _write_weights(tmp: Path, step_dir: Path, manifest: dict[str, Any], adapter: LlamaAdapter,
                   fqn_of: dict[str, str], plan: list[tuple[str, list[Entry]]]) -> None:
    """Tensor by tensor. The checkpoint's shard files are memory-mapped, and the pages a read touches stay resident
    while mapped: the files are mapped afresh after every ``_REMAP_BYTES`` read, so the resident pages stay below
    that plus one tensor, whatever the model's or the output file's size."""
    shards, mapped = Shards(step_dir, manifest), 0
    for file, group in plan:
        writer = ShardWriter(tmp / file, group)
        for entry in group:
            fqn = fqn_of[entry.name]
            meta = manifest["tensors"][MODEL_PREFIX + fqn]
            full = torch.empty(entry.shape, dtype=getattr(torch, meta["dtype"]))
            if mapped and mapped + full.nbytes > _REMAP_BYTES:
                shards, mapped = Shards(step_dir, manifest), 0  # the old maps (and their pages) go with the object
            box = Piece(entry.shape, (0,) * len(entry.shape), entry.shape, full.dtype, False)
            shards.fill(MODEL_PREFIX + fqn, full, box)  # CheckpointError when the pieces do not cover it
            mapped += full.nbytes
            _, tensor = adapter.to_hf(fqn, full)
            writer.write(entry.name, tensor.to(entry.dtype))
            del full, tensor
        writer.close()
        log.info("wrote %s (%d tensors)", file, len(group))


class _Tokenizer:
    """The tokenizer files of the dataset a checkpoint was trained on."""

    def __init__(self, data_dir: Path, given: bool) -> None:
        self.dir = data_dir
        how = "--data" if given else "the checkpoint's data.path"
        fix = "pass --data <the dataset directory the run was trained on>"
        try:
            self.manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no dataset at {data_dir} ({how}): its tokenizer files go into the export; {fix}") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{data_dir}/manifest.json ({how}) cannot be read ({exc}); {fix}") from None
        self.file = data_dir / str(self.manifest.get("tokenizer") or "tokenizer.json")
        if not self.file.is_file():
            raise ConfigError(f"{self.file} is missing ({how}): the export needs the dataset's tokenizer; {fix}")

    def special_ids(self) -> tuple[int | None, int | None]:
        bos, eos = self.manifest.get("bos_id"), self.manifest.get("eos_id")
        return (bos if isinstance(bos, int) else None), (eos if isinstance(eos, int) else None)

    def write(self, out: Path, max_length: int) -> None:
        shutil.copyfile(self.file, out / "tokenizer.json")
        for name in TOKENIZER_FILES:
            if (self.dir / name).is_file():
                shutil.copyfile(self.dir / name, out / name)
        if not (out / "tokenizer_config.json").is_file():  # a dataset built before data prep wrote one
            _write_json(out / "tokenizer_config.json", {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": self.manifest.get("bos_token"),
                "eos_token": self.manifest.get("eos_token"),
                "model_max_length": max_length,
                "clean_up_tokenization_spaces": False,
            })


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` to ``out_dir``; an earlier export there is replaced (moved aside first)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_tmp(out_dir: Path) -> None:
    """Temporary directories of exports to ``out_dir`` whose process is gone (killed mid-export)."""
    for path in out_dir.parent.glob(f".{out_dir.name}{_TMP_INFIX}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not reaper.alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)



def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def parse_size(text: str) -> int:
    """``5GB`` -> 5 * 10**9 (KB, MB, GB: powers of 10; KiB, MiB, GiB: of 2), or plain bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().isdigit():
            return int(upper[: -len(unit)]) * factor
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1048576")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_dir", help="one committed checkpoint: <checkpoint.dir>/step-XXXXXXXX (any world size)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write (created; an earlier export is replaced)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="dtype of the exported weights (default bfloat16; float32 keeps the trained values exactly)")
    parser.add_argument("--data", default=None,
                        help="dataset directory whose tokenizer files to ship (default: the checkpoint's data.path)")
    parser.add_argument("--max-shard-size", type=parse_size, default=MAX_SHARD_BYTES, metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB (the default), 500MB")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = export(args.step_dir, args.out_dir, DTYPES[args.dtype], args.data, args.max_shard_size)
    except ConfigError as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    except CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        return ExitCode.CHECKPOINT_ERROR
    size = summary["bytes"]
    shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    print(f"exported step {summary['step']} ({summary['world_size']} ranks) to {summary['out_dir']}: "
          f"{summary['files']} safetensors file(s), {shown} {summary['dtype']}, {summary['export_time_s']:.1f} s")
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
