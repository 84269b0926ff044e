"""Straggler detection with NVRx's ``nvidia_resiliency_ext.straggler``: find the rank that slows the job, report
it, and (``resiliency.straggler = evict``) end the job so the cluster layer restarts it on other nodes.

In synchronous training one slow rank (a throttled GPU, a degraded link, a busy host) slows every rank, and
nothing fails. NVRx's ``Detector`` times named sections of each step on every rank (``detection_section``) and,
where its CUPTI extension loads, the CUDA kernels launched in them. Every ``straggler_report_every`` steps all
ranks build a report together (``ReportGenerator``: a few small collectives, gathered on rank 0) from the median
section times since the previous report: per rank a **relative** score (the fastest rank's median / this rank's,
1.0 = the fastest) and an **individual** score (this rank's best median so far / its current one).

Which numbers decide (per rank, one relative and one individual score; ``basis`` in the records):

- ``kernels``: NVRx's GPU scores, from CUPTI's kernel timings (NVRx leaves NCCL kernels out: waiting for a peer
  is not slowness). Used where CUPTI profiled kernels (a CUDA device and the extension loaded).
- ``host``: elsewhere, the host-timed sections that hold no collective, ``data`` and ``optimizer``, combined by
  time (sum of the fastest medians / sum of this rank's). ``forward_backward`` holds FSDP's all-gathers and
  reduce-scatters, where every fast rank waits for the slowest, so its time there is the straggler's time on
  every rank and its scores name the fast ranks (probe: 2 gloo ranks, rank 1 1.5x slower in ``data``; the
  collective section scored rank 0 at 0.61, rank 1 at 1.0). Its scores are recorded, never used to decide.
  On a GPU without CUPTI this measures the host (data, kernel launches), not the device.

What runs where (NVRx 0.4.1, probed on a CPU-only torch with 2 gloo ranks): ``Detector.initialize`` builds a
``CuptiManager``, whose extension fails to import without CUDA 12's CUPTI (``ImportError: libcupti.so.12: cannot
open shared object file``); a stand-in without kernel profiling (``_NoKernelProfiler``) takes its place there,
and on a non-CUDA device. ``Detector.generate_report`` starts with ``torch.cuda.synchronize()``, which raises on
a CPU-only torch (``AssertionError: Torch not compiled with CUDA enabled``) and on CUDA waits for every stream,
the snapshot's drain included; the report runs the rest of that method (the section summaries into NVRx's
``ReportGenerator``), on CUDA after waiting for the loop's stream only (``Straggler._report``). ``detection_section``'s CPU timing, the
scores, the gather over gloo and ``rank_to_node`` work as they are. NVRx's time-based report interval
(``generate_report_if_interval_elapsed``) is not used: its interval estimate needs ``torch.cuda.current_device``,
and a step count lets every rank report on the same step without agreeing on a clock.

Start-up: the first report step after each (re)start of the loop only discards the samples so far, on every
rank (no report, no collective): that interval holds start-up work that lands unevenly on the ranks (lazy
FSDP init, the optimizer's state allocation, ``torch.compile``, the snapshot slots reserved in the background,
the first checkpoint writer). Measured on 2 CPU ranks, 5-step interval: the first one scored a healthy rank 0.56.

Policy: rank 0 decides, one broadcast tells every rank, so all act on the same step. A rank below
``straggler_threshold`` is named in a warning, ``metrics.jsonl`` (``{"event": "straggler", ...}`` with every
rank's scores, section medians and step time; TensorBoard ``straggler/*``) and the recovery ledger
(``straggler_report``: the slowest ranks with their hosts). With ``evict``, a rank below it in
``straggler_patience`` reports in a row ends the job: a checkpoint of that step is committed first (a false
alarm costs the restart, no steps), rank 0 writes ``straggler_evicted`` in the ledger, the straggler exits
UNHEALTHY_NODE (201) with one line naming its host and rank, the other ranks exit 201 too without naming it
(``entrypoint.sh`` stops ft_launcher at the first 201, so no in-job restart puts the job back on the same node).
One report above the threshold starts the count again, so a single slow interval evicts nothing.

The host is ``socket.gethostname()`` (the pod's name in Kubernetes), followed by the node's name when the
``NODE_NAME`` environment variable carries it (the downward API's ``spec.nodeName``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch
import torch.distributed as dist

from trainer.exitcodes import ExitCode, TrainerExit

log = logging.getLogger(__name__)

SECTIONS = ("data", "forward_backward", "optimizer")
"""The timed parts of a step, in the loop's order."""
LOCAL_SECTIONS = ("data", "optimizer")
"""Sections without a collective: a rank's time there is its own work, not waiting for a peer."""
KERNEL_SECTIONS = ("forward_backward", "optimizer")
"""Sections whose CUDA kernels NVRx profiles through CUPTI (where it loads)."""
NODE_NAME_ENV = "NODE_NAME"
SLOWEST_IN_LEDGER = 3
NO_RANK = -1.0
_NULL_SECTION = contextlib.nullcontext()


def host_label() -> str:
    """This rank's host for reports and the eviction line: the hostname, and the node's name when known."""
    host = socket.gethostname()
    node = os.environ.get(NODE_NAME_ENV, "")
    return f"{host} (node {node})" if node and node != host else host


# --- per-rank scores from an NVRx report ----------------------------------------------------------------
@dataclass
class RankScore:
    """One rank in one report: the scores that decide, the section medians they come from, its step time."""

    rank: int
    host: str
    relative: float
    individual: float
    step_time_s: float
    sections: dict[str, dict[str, float]] = field(default_factory=dict)
    streak: int = 0

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "relative": _round(self.relative),
                "individual": _round(self.individual), "step_time_s": _round(self.step_time_s, 6),
                "streak": self.streak, "sections": self.sections}

    def brief(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "relative": _round(self.relative),
                "individual": _round(self.individual), "streak": self.streak}


def _round(value: float, digits: int = 4) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def rank_scores(report: Any, median_key: Any) -> tuple[str, list[RankScore]]:
    """(basis, one ``RankScore`` per rank) from a report gathered on rank 0.

    Every rank's section medians follow from NVRx's relative scores: rank 0 knows its own median and its
    relative score, hence the fastest median of the section (``ref``), and rank r's median is ``ref / score``.
    ``median_key`` is NVRx's ``Statistic.MED``.
    """
    relative = report.section_relative_perf_scores
    individual = report.section_individual_perf_scores
    own = report.local_section_summaries
    ref = {s: relative[s][0] * own[s][median_key] for s in relative
           if s in own and _finite(relative[s].get(0)) and _finite(own[s][median_key])}
    ranks = sorted(report.rank_to_node)
    gpu_rel, gpu_ind = report.gpu_relative_perf_scores, report.gpu_individual_perf_scores
    kernels = bool(gpu_rel) and all(_finite(gpu_rel.get(r)) for r in ranks)
    scores = []
    for r in ranks:
        medians = {s: ref[s] / relative[s][r] for s in ref if _finite(relative[s].get(r))}
        sections = {s: {"relative": _round(relative[s][r]), "individual": _round(individual.get(s, {}).get(r, math.nan)),
                        "median_ms": round(medians[s], 4)} for s in medians}
        if kernels:
            rel, ind = gpu_rel[r], gpu_ind.get(r, math.nan)
        else:
            rel, ind = _combined(medians, relative, individual, r)
        scores.append(RankScore(r, report.rank_to_node[r], rel, ind, sum(medians.values()) / 1000, sections))
    return ("kernels" if kernels else "host"), scores


def _combined(medians: Mapping[str, float], relative: Mapping[str, Mapping[int, float]],
              individual: Mapping[str, Mapping[int, float]], rank: int) -> tuple[float, float]:
    """Relative and individual score of the collective-free sections together: each section's score weighted by
    this rank's time in it (sum of reference times / sum of this rank's times)."""
    local = [s for s in LOCAL_SECTIONS if s in medians]
    total = sum(medians[s] for s in local)
    if not local or total <= 0:
        return math.nan, math.nan
    rel = sum(relative[s][rank] * medians[s] for s in local) / total
    ind_parts = [(individual.get(s, {}).get(rank), medians[s]) for s in local]
    ind = (sum(score * t for score, t in ind_parts) / total
           if all(_finite(score) for score, _ in ind_parts) else math.nan)
    return rel, ind


# --- the policy -----------------------------------------------------------------------------------------
class Streaks:
    """Reports in a row each rank spent below the threshold; the rank to evict once one reaches ``patience``."""

    def __init__(self, threshold: float, patience: int) -> None:
        self.threshold = threshold
        self.patience = patience
        self.counts: dict[int, int] = {}

    def update(self, scores: list[RankScore]) -> list[RankScore]:
        """Count this report in; returns the ranks below the threshold, slowest first (their ``streak`` set)."""
        below = []
        for s in scores:
            slow = math.isfinite(s.relative) and s.relative < self.threshold
            self.counts[s.rank] = self.counts.get(s.rank, 0) + 1 if slow else 0
            s.streak = self.counts[s.rank]
            if slow:
                below.append(s)
        return sorted(below, key=lambda s: s.relative)

    def due(self, below: list[RankScore]) -> RankScore | None:
        """The slowest rank that has been below the threshold for ``patience`` reports, else None."""
        return next((s for s in below if s.streak >= self.patience), None)


# --- NVRx, where parts of it cannot run ------------------------------------------------------------------
class _NoKernelProfiler:
    """Stands in for NVRx's ``CuptiManager`` where its CUPTI extension cannot load or there is no CUDA device:
    sections are timed on the host only (``profile_cuda=False``); no kernel statistics."""

    def __init__(self, **kwargs: Any) -> None: ...
    def initialize(self) -> None: ...
    def shutdown(self) -> None: ...
    def get_results(self) -> dict[str, Any]:
        return {}

    def reset_results(self) -> None: ...


def _initialize_detector(cuda: bool, sample_every: int = 1) -> tuple[Any, str | None]:
    """``Detector.initialize`` (all scores, gathered on rank 0, one section entry in ``sample_every`` timed);
    returns (Detector, why kernels are not profiled)."""
    from nvidia_resiliency_ext import straggler as nvrx
    from nvidia_resiliency_ext.straggler import straggler as nvrx_impl

    if nvrx.Detector.initialized:  # class-level state: one detector per process; a previous one is replaced
        nvrx.Detector.shutdown()
    options = dict(scores_to_compute="all", gather_on_rank0=True, node_name=host_label(), profiling_interval=sample_every)
    why = None if cuda else "no CUDA device"
    if why is None:
        try:
            nvrx.Detector.initialize(**options)
            return nvrx.Detector, None
        except Exception as exc:  # ImportError: libcupti.so.12 ... (the extension is built against CUDA 12)
            why = f"NVRx's CUPTI extension is unavailable ({type(exc).__name__}: {exc})"
            nvrx.Detector.initialized = False
    real = nvrx_impl.CuptiManager
    nvrx_impl.CuptiManager = _NoKernelProfiler
    try:
        nvrx.Detector.initialize(**options)
    finally:
        nvrx_impl.CuptiManager = real
    return nvrx.Detector, why


# --- the null object and the detector --------------------------------------------------------------------
class NullStraggler:
    """``resiliency.straggler = off``: nothing is timed, reported or decided."""

    def section(self, name: str) -> ContextManager[Any]:
        return _NULL_SECTION

    def on_loop_start(self) -> None: ...

    def after_step(self, step: int, commit: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


class Straggler(NullStraggler):
    """Per-process state (survives in-process restarts): the NVRx Detector, the streaks (rank 0), the sinks."""

    def __init__(self, rcfg: Any, rank: int, world_size: int, device: torch.device,
                 metrics: Any = None, ledger: Any = None) -> None:
        from nvidia_resiliency_ext.straggler import Statistic

        self.mode, self.every = rcfg.straggler, rcfg.straggler_report_every
        self.rank, self.world_size, self.device = rank, world_size, device
        self.metrics, self.ledger = metrics, ledger
        self.streaks = Streaks(rcfg.straggler_threshold, rcfg.straggler_patience)
        self.warming_up = True  # until the first report step after a (re)start of the loop
        self.median_key = Statistic.MED
        self.cuda = device.type == "cuda"
        self.samples_every = rcfg.straggler_sample_every
        self.detector, why = _initialize_detector(self.cuda, self.samples_every)
        self.profile = {name: self.cuda and why is None and name in KERNEL_SECTIONS for name in SECTIONS}
        if rank == 0:
            basis = "CUDA kernels (CUPTI)" if why is None else f"host-timed sections {' + '.join(LOCAL_SECTIONS)} ({why})"
            log.info("straggler detection (%s): a report every %d steps of one step in %d timed, scores from %s",
                     self.mode, self.every, self.samples_every, basis)

    def section(self, name: str) -> ContextManager[Any]:
        return self.detector.detection_section(name, profile_cuda=self.profile[name])

    def on_loop_start(self) -> None:
        """A (re)start of the loop: samples of an interrupted attempt never enter a report, nor do the start-up
        steps (see the module docstring)."""
        self.warming_up = True
        self._discard_samples()

    def after_step(self, step: int, commit: Callable[[], None]) -> None:
        """Every ``straggler_report_every`` steps, on every rank: the report, the verdict, and its consequence.
        ``commit`` writes a synchronous checkpoint of this step (all ranks)."""
        if step % self.every:
            return
        if self.warming_up:  # the same step on every rank: all (re)start the loop together
            self.warming_up = False
            self._discard_samples()
            return
        report = self._report()
        evict = self._decide(step, report) if self.rank == 0 else None
        verdict = torch.tensor([NO_RANK, math.nan, 0.0] if evict is None else
                               [float(evict.rank), evict.relative, float(evict.streak)], device=self.device)
        if self.world_size > 1:
            dist.broadcast(verdict, src=0)
        if verdict[0].item() == NO_RANK:
            return
        self._evict(step, int(verdict[0].item()), float(verdict[1].item()), int(verdict[2].item()), commit)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # end of the process
            self.detector.shutdown()

    # --- internals ---------------------------------------------------------------------------------------
    def _discard_samples(self) -> None:
        for section in self.detector.custom_sections.values():
            section.cpu_elapsed_times.clear()

    def _report(self) -> Any:
        """NVRx's report (a collective: every rank calls it on the same step); None on ranks other than 0.

        ``Detector.generate_report`` minus its first line, ``torch.cuda.synchronize()``: that waits for every stream
        of the device, and a report step is also a snapshot step (both every 10th), so it waited for the snapshot's
        18 GB device-to-host copy on its side stream (H200, ``1b``: +0.34 s on each report's step). The timed
        sections and the kernels CUPTI traces run on the loop's stream: waiting for it is enough. (And without
        CUDA, ``torch.cuda.synchronize()`` raises.)"""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        d = self.detector
        report = d.reporter.generate_report(d._get_section_summaries(), d._get_kernel_summaries())
        d._reset_sections_elapseds()
        d.cupti_manager.reset_results()
        return report

    def _decide(self, step: int, report: Any) -> RankScore | None:
        """Rank 0: scores into metrics and the ledger, a warning per straggler; the rank to evict, if any."""
        basis, scores = rank_scores(report, self.median_key)
        below = self.streaks.update(scores)
        threshold, patience = self.streaks.threshold, self.streaks.patience
        if self.metrics is not None:
            self.metrics.log({"event": "straggler", "step": step, "basis": basis, "threshold": threshold,
                              "stragglers": [s.rank for s in below], "ranks": [s.record() for s in scores]})
        if self.ledger is not None:
            slowest = sorted((s for s in scores if math.isfinite(s.relative)), key=lambda s: s.relative)
            self.ledger.write("straggler_report", sync=False, step=step, basis=basis, threshold=threshold,
                              slowest=[s.brief() for s in slowest[:SLOWEST_IN_LEDGER]],
                              stragglers=[s.brief() for s in below])
        for s in below:
            streak = f"{s.streak} of {patience} reports in a row before eviction" if self.mode == "evict" else \
                f"{s.streak} report(s) in a row"
            log.warning("straggler at step %d: rank %d on %s runs at %.2f of the fastest rank's speed "
                        "(resiliency.straggler_threshold %.2f; %s)", step, s.rank, s.host, s.relative, threshold, streak)
        return self.streaks.due(below) if self.mode == "evict" else None

    def _evict(self, step: int, rank: int, relative: float, reports: int, commit: Callable[[], None]) -> None:
        """Every rank: commit a checkpoint of this step, then leave with UNHEALTHY_NODE (only the straggler's line
        names its host)."""
        try:
            commit()
            saved = f"a checkpoint of step {step} was committed"
        except Exception as exc:  # the node is still the problem; the relaunch resumes from the previous checkpoint
            saved, step_saved = f"the checkpoint of step {step} failed ({type(exc).__name__}: {exc})", None
        else:
            step_saved = step
        if self.rank == 0 and self.ledger is not None:
            host = self.detector.reporter.rank_to_node.get(rank, "?")
            self.ledger.write("straggler_evicted", step=step, rank=rank, host=host, relative=_round(relative),
                              reports=reports, threshold=self.streaks.threshold, checkpoint=step_saved)
        # FT: the first rank to record 201 makes entrypoint.sh stop ft_launcher; the launcher's SIGTERM must not turn
        # another rank's exit into TERMINATED before it has printed and recorded its own (record_exit does the same)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.rank == rank:
            raise TrainerExit(ExitCode.UNHEALTHY_NODE, (
                f"straggler: rank {rank} on host {host_label()} ran at {relative:.2f} of the fastest rank's speed in "
                f"{reports} report(s) in a row (resiliency.straggler_threshold {self.streaks.threshold:g}); {saved}; "
                "the job ends so the cluster layer restarts it on other nodes"))
        raise TrainerExit(ExitCode.UNHEALTHY_NODE,
                          f"rank {rank} was evicted as a straggler at step {step} (its line names the host); {saved}")


def create(rcfg: Any, rank: int, world_size: int, device: torch.device, metrics: Any = None,
           ledger: Any = None) -> NullStraggler:
    """The straggler layer ``resiliency.straggler`` asks for."""
    if rcfg.straggler == "off":
        return NullStraggler()
    return Straggler(rcfg, rank, world_size, device, metrics=metrics, ledger=ledger)
