"""Per-step metrics as JSON lines (rank 0), MFU from model FLOPs and the device's peak bf16 rate, and the
same scalars plus the recovery events as TensorBoard event files next to ``metrics.jsonl`` (live curves for a
Kubeflow Tensorboard on the shared volume)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RECOVERY_FILE = "recovery.jsonl"  # written by trainer.ledger; read here, never written
TB_FLUSH_S = 10
#: Fields of a ``step`` record drawn as TensorBoard scalars (``train/<field>``).
STEP_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu")

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


class NullTensorBoard:
    """No event files: not rank 0, or the ``tensorboard`` package is missing."""

    def record(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardEvents:
    """Rank 0's TensorBoard event files in ``run_dir``: the scalars of every metrics record and, polled from
    ``recovery.jsonl`` as it grows, the recovery events (faults, restarts per layer, recovery time).

    FT: every (re)start of training (a ``start`` or ``resume`` record) opens a new writer with
    ``purge_step`` = the first step it will run, so TensorBoard hides what earlier attempts logged from that
    step on (the steps a restart redoes would otherwise be drawn twice), and replays the ledger's events from
    that step on, which the purge hid with them."""

    def __init__(self, run_dir: Path, make_writer: Callable[[int | None], Any],
                 ledger_offset: int | None = None) -> None:
        self._make_writer = make_writer
        self._writer: Any = None
        self._ledger = run_dir / RECOVERY_FILE
        # Events of earlier processes are in their own event files; this one starts at the ledger's end (when this
        # process started logging metrics: ``ledger_offset``).
        self._offset = ledger_offset if ledger_offset is not None else ledger_size(run_dir)

    def record(self, record: dict[str, Any]) -> None:
        event, step = record.get("event"), record.get("step")
        if event in ("start", "resume"):
            self._open(purge_step=int(step or 0) + 1)
        elif self._writer is None:
            self._open(purge_step=None)
        if event == "step":
            for name in STEP_SCALARS:
                if record.get(name) is not None:
                    self._writer.add_scalar(f"train/{name}", record[name], step)
        elif event == "straggler":
            self._straggler(record, step)
        elif event == "resume":
            self._writer.add_text("recovery/events", f"resumed from the checkpoint of step {step}", step)
        elif event == "summary":
            for name in ("final_loss", "wall_time_s"):
                if record.get(name) is not None:
                    self._writer.add_scalar(f"summary/{name}", record[name], record.get("steps"))
        self._poll_ledger()
        if event == "summary":
            self._writer.flush()  # the end of training: do not wait for the writer's next periodic flush

    def _open(self, purge_step: int | None) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._make_writer(purge_step)
        if purge_step is not None:
            self._offset = 0
            self._poll_ledger(since_step=purge_step)

    def _straggler(self, record: dict[str, Any], step: int) -> None:
        """A straggler report (``trainer.resiliency.straggler``): each rank's scores and its step time."""
        for r in record.get("ranks", []):
            for name in ("relative", "individual", "step_time_s"):
                if r.get(name) is not None:
                    self._writer.add_scalar(f"straggler/{name}/rank{r['rank']}", r[name], step)
        for rank in record.get("stragglers", []):
            self._writer.add_text("recovery/events", f"straggler: rank {rank} below {record.get('threshold')}", step)

    def _poll_ledger(self, since_step: int = 0) -> None:
        try:
            with self._ledger.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
                if _ledger_step(record) >= since_step:
                    self._recovery(record)
            except (ValueError, TypeError, KeyError):
                continue

    def _recovery(self, r: dict[str, Any]) -> None:
        event = r["event"]
        if event == "fault":
            self._writer.add_scalar(f"recovery/fault_{r['kind']}", 1, r["step"])
            self._writer.add_text("recovery/events", f"fault {r['kind']} on rank {r['rank']} at step {r['step']}",
                                  r["step"])
        elif event == "restart" and r.get("rank") == 0:
            fault = r.get("fault") or {}
            self._writer.add_scalar(f"recovery/restart_{r['layer']}", 1, r["resumed_step"])
            self._writer.add_text("recovery/events", f"{r['layer']} restart after {fault.get('kind', 'a fault')}, "
                                  f"resumed at step {r['resumed_step']}", r["resumed_step"])
        elif event == "straggler_evicted":
            self._writer.add_text("recovery/events", f"straggler rank {r['rank']} on {r['host']} evicted at step "
                                  f"{r['step']} ({r['reports']} reports below {r['threshold']})", r["step"])
        elif event == "recovered":
            self._writer.add_scalar("recovery/recovery_s", r["recovery_s"], r["step"])
            if r.get("steps_redone") is not None:
                self._writer.add_scalar("recovery/steps_redone", r["steps_redone"], r["step"])
        elif event == "preempted":
            self._writer.add_text("recovery/events", f"preempted: final checkpoint at step {r['step']}", r["step"])
        elif event == "summary" and r.get("goodput") is not None:
            self._writer.add_scalar("summary/goodput", r["goodput"], r["steps"])

    def close(self) -> None:
        """Idempotent (also runs at interpreter exit)."""
        if self._writer is not None:
            self._poll_ledger()
            self._writer.close()
            self._writer = None


def _ledger_step(record: dict[str, Any]) -> int:
    """The step a ledger record is drawn at (`TensorBoardEvents._recovery`); KeyError when it has none."""
    key = {"restart": "resumed_step", "summary": "steps"}.get(record["event"], "step")
    return int(record[key])


def straggler_line(record: dict[str, Any]) -> str:
    """The console's line for a straggler report: the slowest ranks, not every rank's record."""
    ranks = sorted((r for r in record.get("ranks", []) if r.get("relative") is not None), key=lambda r: r["relative"])
    slowest = ", ".join(f"rank {r['rank']} ({r['host']}) {r['relative']:.2f}" for r in ranks[:3])
    flagged = record.get("stragglers") or "none"
    return (f"straggler report step {record.get('step')} ({record.get('basis')}): slowest relative {slowest or 'n/a'}; "
            f"below {record.get('threshold')}: {flagged}")


def ledger_size(run_dir: str | Path) -> int:
    ledger = Path(run_dir) / RECOVERY_FILE
    return ledger.stat().st_size if ledger.exists() else 0


def tensorboard_events(run_dir: str | Path, enabled: bool,
                       ledger_offset: int | None = None) -> TensorBoardEvents | NullTensorBoard:
    """TensorBoard events for rank 0 (`enabled`); a `NullTensorBoard` elsewhere or without ``tensorboard``."""
    if not enabled:
        return NullTensorBoard()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        log.warning("no TensorBoard event files (%s): pip install tensorboard for live training curves", exc)
        return NullTensorBoard()

    def make_writer(purge_step: int | None) -> Any:
        return SummaryWriter(log_dir=str(run_dir), flush_secs=TB_FLUSH_S, purge_step=purge_step)

    events = TensorBoardEvents(Path(run_dir), make_writer, ledger_offset)
    atexit.register(events.close)  # what is still queued reaches the file when the process ends normally
    return events


class BackgroundTensorBoard:
    """Rank 0's TensorBoard events, opened in a background thread: importing ``tensorboard`` is not needed before
    the first step (it takes a fraction of a second, seconds where it finds TensorFlow), and a restarted worker
    should not wait for it. Records logged meanwhile are queued and written in order once it is open."""

    def __init__(self, run_dir: Path) -> None:
        self._lock = threading.Lock()
        self._queued: list[dict[str, Any]] = []
        self._events: TensorBoardEvents | NullTensorBoard | None = None
        self._thread = threading.Thread(target=self._open, args=(run_dir, ledger_size(run_dir)),
                                        name="tensorboard-open", daemon=True)
        self._thread.start()

    def _open(self, run_dir: Path, ledger_offset: int) -> None:
        events: TensorBoardEvents | NullTensorBoard = NullTensorBoard()
        try:
            events = tensorboard_events(run_dir, True, ledger_offset)
        except Exception as exc:  # never fail training over its curves
            log.warning("no TensorBoard event files: %s", exc)
        with self._lock:
            for record in self._queued:
                events.record(record)
            self._queued, self._events = [], events

    def record(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._events is None:
                self._queued.append(record)
                return
        self._events.record(record)

    def opened(self) -> TensorBoardEvents | NullTensorBoard:
        """The writer, once open (waits for it)."""
        self._thread.join()
        assert self._events is not None
        return self._events

    def close(self) -> None:
        self.opened().close()


class MetricsLogger:
    """Writes one JSON object per line to ``<run_dir>/metrics.jsonl`` and a short line to stdout (rank 0), and
    the same scalars plus the recovery events as TensorBoard event files in ``run_dir``."""

    def __init__(self, run_dir: str | Path, enabled: bool, echo: bool = True) -> None:
        self.enabled = enabled
        self.echo = echo
        self._file: TextIO | None = None
        self._tensorboard: BackgroundTensorBoard | NullTensorBoard = NullTensorBoard()
        if enabled:
            path = Path(run_dir) / METRICS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)
            self.path = path
            self._tensorboard = BackgroundTensorBoard(path.parent)

    def log(self, record: dict[str, Any]) -> None:
        if not self._file:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record) + "\n")
        self._tensorboard.record(record)
        if self.echo and record.get("event") == "step":
            mfu = f" mfu={record['mfu']:.1%}" if record.get("mfu") is not None else ""
            print(
                f"step {record['step']:>6} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"{record['tokens_per_s']:,.0f} tok/s {record['step_time_s'] * 1000:.0f} ms{mfu}",
                flush=True,
            )
        elif self.echo and record.get("event") == "straggler":
            print(straggler_line(record), flush=True)
        elif self.echo:
            print(json.dumps(record), flush=True)

    def close(self) -> None:
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            self._tensorboard.close()
            self._tensorboard = NullTensorBoard()
