"""Fakes for the pipeline tests: entrypoints and trainer run files (``from pipeline_fakes import ...``)."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path


def write_script(path: Path, body: str) -> Path:
    """An executable Python script (a stand-in for entrypoint.sh or the evaluation CLI)."""
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def write_run_files(run_dir: Path, steps: int, restarts: dict[str, int] | None = None) -> None:
    """metrics.jsonl, summary.json and recovery.jsonl as the trainer writes them (trainer/ledger.py schema)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = 1_700_000_000.0
    metrics = [{"event": "start", "time": t0, "model": "tiny", "world_size": 2}]
    metrics += [{"event": "step", "time": t0 + s, "step": s, "loss": 8.0 - s * 0.05, "lr": 1e-3,
                 "tokens_per_s": 1000.0, "step_time_s": 1.0, "mfu": None} for s in range(1, steps + 1)]
    summary = {"event": "summary", "steps": steps, "tokens": steps * 2048, "final_loss": 8.0 - steps * 0.05,
               "wall_time_s": steps * 1.2, "world_size": 2}
    metrics.append(summary)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    ledger = [{"event": "start", "time": t0, "rank": 0}]
    t = t0 + 5
    for layer, n in (restarts or {}).items():
        for _ in range(n):
            ledger.append({"event": "fault", "kind": "sigkill", "step": 5, "time": t, "rank": 1})
            for rank in (1, 0):  # every rank writes its restart record, as the trainer does
                ledger.append({"event": "restart", "layer": layer, "resumed_step": 4, "time": t + 2, "rank": rank,
                               "fault": {"kind": "sigkill", "step": 5, "time": t}})
            ledger.append({"event": "recovered", "layer": layer, "step": 5, "fault_kind": "sigkill", "fault_step": 5,
                           "recovery_s": 3.0, "steps_redone": 0, "time": t + 3, "rank": 0})
            t += 10
    ledger.append({"event": "summary", "steps": steps, "wall_s": 100.0, "productive_s": 80.0, "goodput": 0.8,
                   "time": t + 50, "rank": 0})
    (run_dir / "recovery.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger) + '{"torn": ')


def write_safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A valid safetensors file of float32 zeros with these tensor shapes (the format: an 8-byte little-endian
    header length, the JSON header, the data)."""
    import struct

    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4
        for n in shape:
            size *= n
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def write_export(out: Path, shards: int = 1, architecture: str = "LlamaForCausalLM") -> None:
    """What ``python -m trainer.export`` writes (CONTRACTS.md item 2), with tiny random-free weights: a stand-in
    for unit tests of the export step's plumbing only."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "llama",
                                                 "hidden_size": 8, "num_hidden_layers": 1}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": 0}))
    (out / "tokenizer.json").write_text("{}")
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    if shards == 1:
        write_safetensors(out / "model.safetensors", {n: [4, 8] for n in names})
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        write_safetensors(out / file, {n: [4, 8] for n in part})
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def fake_export_cli(path: Path, code: int = 0, shards: int = 1) -> Path:
    """Stands in for ``python -m trainer.export STEP_DIR OUT_DIR --dtype D``: checks its arguments, prints, and
    writes `write_export`'s directory (or exits `code`)."""
    helper = Path(__file__).resolve().parent
    return write_script(path, f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(helper)!r})
        from pipeline_fakes import write_export
        step_dir, out, flag, dtype = sys.argv[1:]
        assert flag == "--dtype" and dtype in ("bfloat16", "float32"), sys.argv
        print(f"exporting {{step_dir}} as {{dtype}}", flush=True)
        if {code}:
            print("checkpoint error: shard-00000-of-00002.pt is truncated", file=sys.stderr)
            sys.exit({code})
        write_export(Path(out), shards={shards})
        print(f"exported {{step_dir}} -> {{out}}")
    """)
