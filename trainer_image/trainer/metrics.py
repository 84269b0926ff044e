"""Per-step metrics as JSON lines (rank 0), MFU from model FLOPs and the device's peak bf16 rate."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

import torch

# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989.5e12,
    "H100 SXM": 989.5e12,
    "H100 80GB HBM3": 989.5e12,
    "H100 PCIe": 756.5e12,
    "H100 NVL": 835.5e12,
    "GH200": 989.5e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362.05e12,
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``; None on CPU or an unknown GPU (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


class MetricsLogger:
    """Writes one JSON object per line to ``<run_dir>/metrics.jsonl`` and a short line to stdout (rank 0)."""

    def __init__(self, run_dir: str | Path, enabled: bool, echo: bool = True) -> None:
        self.enabled = enabled
        self.echo = echo
        self._file: TextIO | None = None
        if enabled:
            path = Path(run_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)
            self.path = path

    def log(self, record: dict[str, Any]) -> None:
        if not self._file:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record) + "\n")
        if self.echo and record.get("event") == "step":
            mfu = f" mfu={record['mfu']:.1%}" if record.get("mfu") is not None else ""
            print(
                f"step {record['step']:>6} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"{record['tokens_per_s']:,.0f} tok/s {record['step_time_s'] * 1000:.0f} ms{mfu}",
                flush=True,
            )
        elif self.echo:
            print(json.dumps(record), flush=True)

    def close(self) -> None:
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
