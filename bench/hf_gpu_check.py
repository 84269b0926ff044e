"""GPU check of the Hugging Face round trip at the ``1b`` shape (Llama 3.2 1B: tied embeddings, llama3 RoPE
scaling): a random-weight ``LlamaForCausalLM`` made by transformers (no network) is the base model; the trainer
starts from it on the GPU (``model.from_hf``), trains a few steps and commits a checkpoint; ``trainer.export``
writes it as a Hugging Face directory; transformers loads that on the GPU and its loss on 8 validation batches
is compared with ``trainer.evaluate`` on the same checkpoint. Prints one JSON line.

    source bench/gpu_env.sh   # on the lent machine: NVRx + transformers/safetensors wheels from .whl/
    python3 bench/hf_gpu_check.py [--out runs/hf-check] [--steps 20] [--nproc 1]

Needs a CUDA device and transformers; writes about 8 GB (base model, checkpoint, export) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SEQ, BATCH, EVAL_BATCHES = 1024, 4, 8
_EXPORT_WITH_RSS = ("import resource, sys\nfrom trainer.export import main\ncode = main(sys.argv[1:])\n"
                    "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)")
"""``python -m trainer.export`` that also prints its peak resident memory (the export runs on CPU)."""


def make_base(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").is_file():
        return
    config = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, bos_token_id=None, eos_token_id=0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)  # sharded at 5 GB like the Hub's files


def run(cmd: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"{' '.join(cmd[:6])} ... failed with exit {code}; see {log}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf-check")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, base, run_dir, export_dir = out / "data", out / "base", out / "run", out / "export"
    if not (data / "manifest.json").is_file():
        run([sys.executable, "-m", "components.lib.tokendata", "--out", str(data), "--vocab-size", "4096",
             "--max-bytes", "12000000"], out / "data.log")
    make_base(base)
    train_s = run(["torchrun", "--standalone", f"--nproc-per-node={args.nproc}", "-m", "trainer", "--config", "1b",
                   f"--model.from_hf={base}", f"--data.path={data}", f"--train.run_dir={run_dir}",
                   f"--train.steps={args.steps}", f"--data.seq_len={SEQ}", f"--train.batch_size={BATCH}",
                   "--optim.warmup_steps=5", "--checkpoint.interval=0", "--train.compile=false"], out / "train.log")
    step_dir = run_dir / "checkpoints" / f"step-{args.steps:08d}"
    export_s = run([sys.executable, "-c", _EXPORT_WITH_RSS, str(step_dir), str(export_dir), "--dtype", "bfloat16"],
                   out / "export.log")
    peak_rss = int(next(line.split()[1] for line in (out / "export.log").read_text().splitlines()
                        if line.startswith("peak_rss_kib")))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import ShardedTokens, eval_batches
    from trainer.evaluate import evaluate

    ours = evaluate(run_dir / "checkpoints", data, batch_size=BATCH, max_batches=EVAL_BATCHES, device="cuda")
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16, device_map="cuda").eval()
    AutoTokenizer.from_pretrained(export_dir)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in eval_batches(ShardedTokens(data, split="val"), SEQ, BATCH, 0, 1, EVAL_BATCHES):
            logits = model(input_ids=inputs.cuda()).logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), targets.cuda().flatten(), reduction="sum").item()
            tokens += targets.numel()
    hf_loss = total / tokens
    files = sorted(p.name for p in export_dir.glob("*.safetensors"))
    print(json.dumps({
        "check": "hf_export_1b", "device": torch.cuda.get_device_name(), "steps": args.steps, "nproc": args.nproc,
        "trainer_val_loss": ours["val_loss"], "transformers_val_loss": hf_loss,
        "rel_diff": abs(hf_loss - ours["val_loss"]) / ours["val_loss"], "val_tokens": tokens,
        "export_files": files, "export_bytes": sum((export_dir / f).stat().st_size for f in files),
        "train_s": round(train_s, 1), "export_s": round(export_s, 1), "export_peak_rss_gib": round(peak_rss / 2**20, 2),
        "checkpoint_bytes": sum(p.stat().st_size for p in step_dir.glob("shard-*.pt")),
        "trainer_version": os.environ.get("RESILIENT_TRAIN_VERSION", ""),
    }))


if __name__ == "__main__":
    main()
