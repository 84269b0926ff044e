"""CPU benchmark of ``python -m trainer.export``: time and peak resident memory for one checkpoint, per
``--max-shard-size`` and remap threshold. The export holds one tensor at a time and maps the checkpoint's shard
files afresh after every ``_REMAP_BYTES`` (1 GiB) read, so its peak memory should follow that threshold plus the
largest tensor, not the model or the output file size.

    PYTHONPATH=.:trainer_image python bench/export_memory.py [--out runs/export-bench] [--dim 1024 --layers 8]

A random-weight ``LlamaForCausalLM`` of the given shape (transformers) is the base model; the trainer starts from
it for one step with lr 0 (one CPU process) and commits the checkpoint (weights and AdamW state); then the export
runs in a child process per shard size. One JSON line per export.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = ("import os, resource, sys, time\nimport trainer.export as export\n"
         "export._REMAP_BYTES = int(os.environ['REMAP_MIB']) * 2**20\nt = time.perf_counter()\n"
         "code = export.main(sys.argv[1:])\n"
         "print('bench', time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)")
"""``python -m trainer.export`` with its remap threshold set from $REMAP_MIB, printing its time and peak RSS."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/export-bench")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-sizes", default="100MB,5GB")
    parser.add_argument("--remap-mib", default="1024,128",
                        help="thresholds to try for the export's remap of the checkpoint files (its default: 1024)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, base, run = out / "data", out / "base", out / "run"
    if not (data / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "components.lib.tokendata", "--out", str(data), "--vocab-size", "2048",
                        "--max-bytes", "2000000"], check=True, capture_output=True)
    if not (base / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
                             num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
                             num_key_value_heads=args.dim // 256, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(base)
    step_dir = run / "checkpoints" / "step-00000001"
    if not step_dir.is_dir():
        subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", f"--model.from_hf={base}",
                        f"--data.path={data}", f"--train.run_dir={run}", "--train.steps=1", "--optim.lr=0",
                        "--data.seq_len=64", "--train.batch_size=1", f"--checkpoint.node_local_dir={out / 'node'}"],
                       check=True, capture_output=True)
    ckpt_bytes = sum(p.stat().st_size for p in step_dir.glob("shard-*.pt"))
    import os

    for size, remap in [(s, r) for s in args.shard_sizes.split(",") for r in args.remap_mib.split(",")]:
        result = subprocess.run([sys.executable, "-c", CHILD, str(step_dir), str(out / f"export-{size}"),
                                 "--max-shard-size", size], capture_output=True, text=True, check=True,
                                env={**os.environ, "REMAP_MIB": remap})
        line = next(line for line in result.stdout.splitlines() if line.startswith("bench "))
        seconds, rss_kib = float(line.split()[1]), int(line.split()[2])
        files = sorted((out / f"export-{size}").glob("*.safetensors"))
        print(json.dumps({"bench": "export_memory", "max_shard_size": size, "remap_mib": int(remap), "files": len(files),
                          "largest_file_mib": round(max(f.stat().st_size for f in files) / 2**20, 1),
                          "export_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
                          "checkpoint_mib": round(ckpt_bytes / 2**20, 1), "peak_rss_mib": round(rss_kib / 1024, 1),
                          "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    main()
