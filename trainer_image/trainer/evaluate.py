"""Held-out evaluation of the latest valid checkpoint, in one process on any device.

``python -m trainer.evaluate --checkpoint-dir DIR --data DIR [--batch-size N] [--max-batches N] --out FILE``
writes ``{"step", "val_loss", "perplexity", "val_tokens", "checkpoint", "model"}`` as JSON. A checkpoint written
by any number of ranks loads here (its shards are reassembled from the stored sharding metadata).
Exit codes follow ``trainer.exitcodes``: 3 for bad data, 4 when no valid checkpoint exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.checkpoint import CheckpointError, committed_steps, find_valid_checkpoint, load_model_weights
from trainer.config import JobConfig
from trainer.data import ShardedTokens, ShardError, eval_batches
from trainer.exitcodes import ExitCode
from trainer.model import Transformer

log = logging.getLogger(__name__)


def evaluate(
    checkpoint_dir: str | Path,
    data_path: str | Path,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Validation loss and perplexity of the newest valid checkpoint in ``checkpoint_dir``."""
    started = time.perf_counter()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if not committed_steps(Path(checkpoint_dir)):
        raise CheckpointError(_nothing_committed(Path(checkpoint_dir)))
    path, manifest = find_valid_checkpoint(checkpoint_dir)
    step = int(manifest["step"])
    cfg = JobConfig.from_dict(manifest["config"], source=f"{path}/manifest.json (stored config)")
    weights = load_model_weights(checkpoint_dir, step)
    val = ShardedTokens(data_path, split="val")
    if val.vocab_size > cfg.model.vocab_size:
        raise ShardError(
            f"{val.path}: the dataset's vocabulary ({val.vocab_size}) is larger than the model's "
            f"({cfg.model.vocab_size}); evaluate with the dataset the model was trained on"
        )
    with torch.device(dev):
        model = Transformer(cfg.model, max_seq_len=cfg.data.seq_len)
    model.load_state_dict(weights)
    model.eval()
    total_loss, total_tokens = 0.0, 0
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    with torch.no_grad(), autocast:
        for inputs, targets in eval_batches(val, cfg.data.seq_len, batch_size, 0, 1, max_batches):
            logits = model(inputs.to(dev))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(dev).flatten(0, 1), reduction="sum")
            total_loss += loss.item()
            total_tokens += targets.numel()
    if total_tokens == 0:
        raise ShardError(
            f"{val.path}: the val split has fewer than {batch_size} samples of {cfg.data.seq_len + 1} tokens; "
            "lower --batch-size or build the dataset with a larger val_fraction"
        )
    val_loss = total_loss / total_tokens
    return {
        "step": step,
        "val_loss": val_loss,
        "perplexity": math.exp(min(val_loss, 80.0)),
        "val_tokens": total_tokens,
        "checkpoint": str(path),
        "model": cfg.model.name,
        "eval_time_s": time.perf_counter() - started,
    }


def _nothing_committed(directory: Path) -> str:
    """Why ``directory`` holds no checkpoint to evaluate, in one self-contained line."""
    if not directory.exists():
        return f"{directory} does not exist; pass the run's checkpoint directory as --checkpoint-dir"
    if not directory.is_dir():
        return f"{directory} is not a directory; pass the run's checkpoint directory as --checkpoint-dir"
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return f"{directory} is empty: no checkpoint was saved yet; train until one is committed"
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"no committed checkpoint in {directory}: it holds only {shown} (a *.tmp directory is a save that "
            "never finished, *.corrupt-* ones were set aside as invalid); train until a checkpoint is committed")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True, help="the run's checkpoint directory")
    parser.add_argument("--data", required=True, help="dataset directory (its val split is used)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int, default=None, help="limit the evaluation (default: all)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    if args.batch_size <= 0 or (args.max_batches is not None and args.max_batches <= 0):
        parser.error("--batch-size and --max-batches must be > 0")
    try:
        result = evaluate(args.checkpoint_dir, args.data, args.batch_size, args.max_batches, args.device)
    except CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        return ExitCode.CHECKPOINT_ERROR
    except ShardError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return ExitCode.DATA_ERROR
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
