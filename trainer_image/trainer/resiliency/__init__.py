"""The recovery layers composed around the restartable ``train()``; the only trainer module (with
``checkpoint``) that imports NVRx.

Layers, each switchable from ``[resiliency]`` config, each a null object when off, so the same loop runs
under plain ``torchrun``, under ``ft_launcher`` (``entrypoint.sh``), with or without the Wrapper:

1. **in-process** (``resiliency.inprocess``): NVRx ``inprocess.Wrapper`` restarts ``train()`` in the same
   processes on an exception or a hang (soft timeout). Each restart rebuilds the process group from
   ``PrefixStore(str(call_wrapper.iteration), base_store)`` and reloads the latest state (the checkpoint
   manager's in-memory copy when it is current, else disk). ``call_wrapper.ping()`` every step; the
   checkpoint save runs under ``call_wrapper.atomic()``. On CPU/gloo a blocked collective cannot be
   aborted (``AbortTorchDistributed`` is NCCL-only), so config requires the gloo timeout below the soft
   timeout. ``FaultCounter`` + node health checks decide whether a rank may restart; beyond
   ``inprocess_max_restarts`` the process exits RESTART_BUDGET_EXHAUSTED.
   Stores: the Wrapper's store and the training ``base_store`` share one TCPStore on ``MASTER_PORT``, under a
   key prefix per in-job attempt where the store outlives one (torchrun's agent's store), a fixed one where each
   rendezvous round has a new store (the launchers' restart counts differ across nodes). Under torchrun the agent serves it (no rank is critical, so the hard timeout killing
   rank 0 does not take the job down; it outlives in-job restarts). Under ft_launcher (its c10d rendezvous does
   not share the agent's store) and without a launcher, rank 0 serves it, as ``env://`` would: never on ports
   next to ``MASTER_PORT``, which nobody reserved (a port taken there made NVRx's store fall back to a client of
   whatever held it, and both ranks waited 2 x 300 s to connect).
2. **in-job** (``resiliency.heartbeats``): NVRx ``RankMonitorClient`` heartbeats to ``ft_launcher``'s rank
   monitors every step (a null object when ``FT_RANK_MONITOR_IPC_SOCKET`` is unset). Timeouts are
   computed from observed intervals (``calculate_and_set_hb_timeouts``) once a checkpoint save has been
   observed, never below the in-process hard timeout (layers nest outward), the first heartbeat's never
   below ft_launcher's (a respawned worker loads its checkpoint before it beats), and persisted in the
   checkpoint as ``state["ft"]``. With both layers on, NVRx's nested-restarter callbacks tell the launcher
   about in-process restarts.
3. **cluster**: when a budget is spent, the node is unhealthy or the pod is preempted, the process exits
   with the retryable codes of ``trainer.exitcodes`` and the PyTorchJob / pipeline retry restarts it.

Plus: SIGTERM (preemption, ``trainer.resiliency.preemption``), fault injection (``trainer.faults``), the recovery ledger
(``trainer.ledger``), node health checks (``trainer.health``) and straggler detection
(``resiliency.straggler``, NVRx ``straggler.Detector``: ``trainer.resiliency.straggler``).
"""

# No ``from __future__ import annotations``: NVRx injects the CallWrapper by the evaluated annotation.
import contextlib
import datetime
import gc
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from trainer.startup import phases
from trainer.config import ConfigError, JobConfig
from trainer.exitcodes import ExitCode, TrainerExit, classify, is_retryable
from trainer.faults import FaultInjector, parse_faults
from trainer.ledger import Ledger, mark_started, node_joined, sum_by_key
from trainer.resiliency import device as device_handover
from trainer.resiliency import straggler as stragglers
from trainer.resiliency.heartbeat import FT_SOCKET_ENV, Heartbeat, NullHeartbeat
from trainer.resiliency.launch import free_port
from trainer.resiliency.preemption import Preemption

log = logging.getLogger(__name__)

TERM_TIMEOUT_ENV = "TRAINER_TERM_TIMEOUT_S"  # exported by entrypoint.sh: ft_launcher's --term-timeout
STORE_TIMEOUT = datetime.timedelta(seconds=300)
BARRIER_MARGIN_S = 30.0  # Wrapper barriers wait this much beyond hard timeout + termination grace
INJOB_MARGIN_S = 10.0  # launcher heartbeat timeouts stay this much above the in-process hard timeout


# --- the composition ----------------------------------------------------------------------------------
class NullFaults:
    def maybe_fire(self, step: int) -> None: ...

    def slowed(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class Layers:
    """Per-process resiliency state; built once, survives in-process restarts. The loop calls its hooks."""

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, local_rank: int, device: torch.device,
                 heartbeat: NullHeartbeat, ledger: Ledger | None, faults: Any, health: list[Any],
                 straggler: stragglers.NullStraggler | None = None) -> None:
        self.cfg, self.rcfg = cfg, cfg.resiliency
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self.heartbeat = heartbeat
        self.ledger = ledger
        self.faults = faults
        self.health = health
        self.straggler = straggler or stragglers.NullStraggler()
        self.preemption = Preemption(cfg.resiliency.preemption_grace_s)
        self.call_wrapper: Any = None
        self.new_node = node_joined(local_rank) if ledger is not None else None
        """Whether this worker is the first of its local rank in its pod (the ledger's ``node`` layer)."""
        self.starting = False
        """Between a (re)start of the loop and the end of its first step (its phases are reported then)."""
        self.device_need = device_handover.NeedRecord.from_environ(local_rank) if device.type == "cuda" else None
        """This local rank's device memory peak, for the worker that takes over after this one."""

    @classmethod
    def create(cls, cfg: JobConfig, rank: int, world_size: int, local_rank: int,
               device: torch.device, metrics: Any = None, ledger: Ledger | None = None) -> "Layers":
        r = cfg.resiliency
        run_dir = Path(cfg.train.run_dir)
        ledger = ledger if ledger is not None else Ledger(run_dir, rank, world_size)
        specs = parse_faults(r.faults)
        faults: Any = NullFaults()
        if any(s.rank == rank for s in specs):
            faults = FaultInjector(specs, run_dir, rank, cfg.checkpoint_dir,
                                   on_fire=lambda spec: ledger.fault(spec.kind, spec.step))
        under_ft = bool(os.environ.get(FT_SOCKET_ENV))
        if r.heartbeats == "on" and not under_ft:
            raise ConfigError(
                f"resiliency.heartbeats=on needs ft_launcher ({FT_SOCKET_ENV} is unset): start through "
                "trainer_image/entrypoint.sh, or set resiliency.heartbeats=auto"
            )
        if under_ft and r.heartbeats != "off":
            term_timeout = float(os.environ.get(TERM_TIMEOUT_ENV, "inf"))
            if r.preemption_grace_s >= term_timeout:
                raise ConfigError(
                    f"resiliency.preemption_grace_s ({r.preemption_grace_s:g}) must be below ft_launcher's "
                    f"--term-timeout ({term_timeout:g} s, FT_TERM_TIMEOUT in entrypoint.sh), or the launcher "
                    "kills ranks during their final checkpoint"
                )
            floor = r.hard_timeout_s + r.termination_grace_s + INJOB_MARGIN_S if r.inprocess else None
            heartbeat: NullHeartbeat = Heartbeat(floor)
        else:
            heartbeat = NullHeartbeat()
        health: list[Any] = []
        if r.health_checks:
            from trainer.health import node_checks

            health = node_checks(local_rank, r.sysfs_root)
        # FT: the Wrapper's health check sees the exception behind an in-process restart: the ledger names it
        health.append(lambda state: ledger.note_exception(getattr(state, "fn_exception", None)) or state)
        straggler = stragglers.create(r, rank, world_size, device, metrics=metrics, ledger=ledger)
        return cls(cfg, rank, world_size, local_rank, device, heartbeat, ledger, faults, health, straggler)

    def fit_before(self) -> bool:
        """Whether a worker of this local rank (this one, or one before it in this pod) completed a step on the GPU."""
        record = self.device_need
        return record is None or record.written > 0 or record.read() > 0

    @classmethod
    def null(cls) -> "Layers":
        """Every layer off (unit tests, tools): hooks do nothing."""
        return cls(JobConfig(), 0, 1, 0, torch.device("cpu"), NullHeartbeat(), None, NullFaults(), [])

    # --- hooks called by train() / _loop() ---------------------------------------------------------------
    @property
    def ft_state(self) -> NullHeartbeat:
        """Goes into the checkpointed state as ``state["ft"]`` (state_dict / load_state_dict)."""
        return self.heartbeat

    def on_loop_start(self, resumed_step: int, tier: str | None = None,
                      gather: Callable[[Any], list[Any]] | None = None, read: dict[str, int] | None = None) -> None:
        """The loop (re)starts at ``resumed_step``, this rank's state read from ``tier`` (``read``: bytes per tier);
        ``gather`` (an all-gather over the ranks, collective) tells the ledger which ranks' nodes joined the job,
        where each rank resumed and the bytes the ranks read from each tier."""
        self.starting = True
        self.preemption.restart()
        if self.ledger is not None:
            joined, tiers, total = None, None, dict(read or {})
            if gather is not None:
                members = gather((self.new_node, tier, read or {}))
                tiers, total = [t for _, t, _ in members], sum_by_key([r for _, _, r in members])
                if all(new is not None for new, _, _ in members):
                    joined = [rank for rank, (new, _, _) in enumerate(members) if new]
            self.ledger.on_train_start(self.iteration, resumed_step, tier=tier, joined=joined, tiers=tiers,
                                       bytes_read=total)
            if self.new_node:
                mark_started(self.local_rank)
        self.straggler.on_loop_start()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A timed part of the step (``straggler.SECTIONS``): NVRx straggler detection times it; once an injected
        ``slow`` fault fired, the rank sleeps a fraction of it inside."""
        with self.straggler.section(name), self.faults.slowed():
            yield

    def record(self, event: str, sync: bool = True, **fields: Any) -> None:
        """A decision worth keeping in the recovery ledger (rank 0's view); ``sync``: ``Ledger.write``'s."""
        if self.ledger is not None and self.rank == 0:
            self.ledger.write(event, sync=sync, **fields)

    def before_step(self, step: int) -> None:
        self.keepalive()
        self.faults.maybe_fire(step)

    def keepalive(self) -> None:
        """This rank is alive and making progress: the in-process progress ping and the in-job heartbeat (every
        step; and while a blocking save waits on a disk that is still writing, see ``CheckpointManager``)."""
        if self.call_wrapper is not None:
            self.call_wrapper.ping()
        self.heartbeat.beat()

    def after_step(self, step: int, checkpointer: Any, state: dict[str, Any], saved: bool) -> None:
        if saved:
            self.heartbeat.on_save()
        if saved or self.starting:  # FT: the peak a successor waits for (a snapshot's staging buffer included)
            device_handover.note_peak(self.device_need, self.device)
        start = self._first_step_done(checkpointer) if self.starting else None
        if self.ledger is not None:
            self.ledger.on_step_end(step, start)
        # FT: a straggler report every straggler_report_every steps; evict: commit this step, end the job (201)
        self.straggler.after_step(step, lambda: self._commit(checkpointer, step, state))
        if self.preemption.agreed(self.device, self.world_size):
            try:
                with self.atomic():  # synchronous: returns once committed (a no-op wait if step was saved)
                    checkpointer.save(step, state, force=True)
            except Exception as exc:  # not permanent: the previous checkpoints are intact, resume from them
                raise TrainerExit(ExitCode.TERMINATED, f"preempted; the final checkpoint failed: {exc}") from exc
            self.preemption.committed = True
            if self.ledger is not None and self.rank == 0:
                self.ledger.write("preempted", step=step)
            raise TrainerExit(ExitCode.PREEMPTED, f"preempted: final checkpoint of step {step} committed")

    def _commit(self, checkpointer: Any, step: int, state: dict[str, Any]) -> None:
        with self.atomic():  # synchronous: returns once committed (a no-op wait if step was saved)
            checkpointer.save(step, state, force=True)

    def _first_step_done(self, checkpointer: Any) -> dict[str, Any] | None:
        """The first step of this (re)start ended: log its phases; returned for the ledger's ``recovered``."""
        self.starting = False
        clock = phases.CLOCK
        clock.mark("first_step")
        measured = clock.take()
        if measured is None:  # nothing marked since the last report
            return None
        marks = clock.take_marks()
        if not clock.reentry:  # a new process: nothing of an in-process restart came before this start
            marks = {}
        phases.report(log, measured, clock.reentry, marks)
        phases.first_step_done(checkpointer.snapshot_files())  # FT: the standby server may now warm a replacement
        if self.call_wrapper is not None:  # what the Wrapper's full collections will scan at the next restart
            log.info("garbage collector: %s", phases.unfrozen_summary())
        return {"origin": clock.origin, "end": clock.last_mark, "phases": measured, "marks": marks}

    def on_train_end(self, steps: int) -> None:
        self.preemption.drain()
        if self.ledger is not None:
            self.ledger.summarize(steps)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the in-process restart must not interrupt (a checkpoint commit)."""
        if self.call_wrapper is None:
            yield
        else:
            with self.call_wrapper.atomic():
                yield

    @property
    def iteration(self) -> int:
        return self.call_wrapper.iteration if self.call_wrapper is not None else 0

    def check_health(self) -> None:
        for check in self.health:
            check(None)


NULL = Layers.null


# --- running train() under the layers -----------------------------------------------------------------
TrainFn = Callable[..., dict[str, Any]]


def run(res: Any, train_fn: TrainFn, ledger: Ledger | None = None) -> dict[str, Any]:
    """Run ``train_fn(res, store, layers)`` under the configured layers; raises ``TrainerExit`` or the
    exception that ended training (``exitcodes.classify`` maps it). ``ledger``: the process's recovery ledger
    (the CLI's, which records its exit), else a new one."""
    env = res.env
    layers = Layers.create(res.cfg, env.rank, env.world_size, env.local_rank, res.device, metrics=res.metrics,
                           ledger=ledger)
    layers.check_health()  # NodeUnhealthy -> UNHEALTHY_NODE before anything else starts
    layers.preemption.install()
    # FT: NVRx collects garbage in full before every in-process restart (``while gc.collect()``): the ~260k objects of
    # the imported modules and of this process's resources, frozen here, are not scanned again (0.15 s a pass on CPU)
    phases.freeze_collector()
    phases.CLOCK.mark("layers")
    try:
        if res.cfg.resiliency.inprocess:
            return _run_inprocess(res, train_fn, layers)
        layers.heartbeat.start()
        return _call(train_fn, res, None, layers)
    finally:
        layers.heartbeat.stop()
        layers.straggler.close()


def _call(train_fn: TrainFn, res: Any, store: Any, layers: Layers) -> dict[str, Any]:
    try:
        return train_fn(res, store, layers)
    except Exception as exc:
        code = classify(exc)
        if code == ExitCode.DEVICE_OUT_OF_MEMORY and not layers.fit_before():
            # FT: no restart makes a model fit that never ran a step on this card: one line with what to change
            raise TrainerExit(ExitCode.CONFIG_ERROR, f"the job does not fit on {res.device} before its first step "
                              f"completed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}): lower "
                              "train.batch_size or data.seq_len, or train on more GPUs") from exc
        if code != ExitCode.CODE_ERROR and not is_retryable(code):
            # Permanent (config, data, checkpoint): no restart can help. TrainerExit is a BaseException,
            # so it passes through the Wrapper instead of triggering an in-process restart.
            raise TrainerExit(code, f"{type(exc).__name__}: {exc}") from exc
        raise


def _stores(world_size: int, rank: int) -> tuple[Any, dict[str, Any], dist.Store]:
    """(Wrapper store factory, its kwargs, training base store); see the module docstring."""
    from nvidia_resiliency_ext.inprocess.store import StoreMixin

    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.setdefault("MASTER_PORT", str(free_port())))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    # FT: keys are per in-job attempt only in the agent's store, the one store that outlives an attempt (torchrun,
    # one agent: its count is the job's). Where rank 0 serves the store, every rendezvous round has a new one, and the
    # launchers' restart counts differ across nodes (a node restarted because another re-joined counts none), so a
    # count in the key would split the ranks of one round between two barriers.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent else "round"
    if agent:  # torchrun: the agent serves a store on MASTER_PORT
        server = dist.TCPStore(addr, port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True)
    else:  # ft_launcher (c10d), or no launcher: rank 0 serves it, as for env:// (MASTER_PORT is free for it)
        server = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=STORE_TIMEOUT,
                               wait_for_workers=True, use_libuv=True)

    class JobStore(dist.PrefixStore, StoreMixin):
        """The Wrapper's store: a client of the job's store (its own connection: NVRx's monitor process makes one
        too), keys prefixed per in-job attempt where the store outlives one (the agent's). Rank 0 is critical where
        it serves the store."""

        def __init__(self, port: int, prefix: str) -> None:
            super().__init__(prefix, dist.TCPStore(addr, port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True))

        critical_ranks = () if agent else (0,)  # NVRx's StoreMixin: a rank whose loss ends in-process restarts

    return JobStore, {"port": port, "prefix": f"trainer/attempt_{attempt}/nvrx"}, \
        dist.PrefixStore(f"trainer/attempt_{attempt}/pg", server)


class _DistributedAbort:
    """NVRx's ``AbortTorchDistributed``, its two steps timed apart: every group's NCCL backend aborted (in threads),
    then every group destroyed. ``detail`` says how long each took, over which groups, for the abort's log line."""

    def __init__(self, impl: Any) -> None:
        self.impl, self.detail = impl, ""

    def __call__(self, state: Any) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            self.detail = " (no process group)"
            return state
        groups = [_group_label(group) for group in dist.distributed_c10d._world.pg_names]
        began = time.perf_counter()
        self.impl.shutdown_all_process_group_backends()
        aborted = time.perf_counter()
        dist.destroy_process_group()
        self.detail = (f" (backends aborted {aborted - began:.3f} s, groups destroyed {time.perf_counter() - aborted:.3f}"
                       f" s; {len(groups)} groups: {', '.join(groups)})")
        return state


def _group_label(group: Any) -> str:
    """``gloo`` / ``nccl`` / ``cpu:gloo,cuda:nccl``, with its size: for the abort's log line."""
    with contextlib.suppress(Exception):
        return f"{dist.get_backend(group)}x{group.size()}"
    return type(group).__name__


def _run_inprocess(res: Any, train_fn: TrainFn, layers: Layers) -> dict[str, Any]:
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess import nested_restarter as nested

    from trainer.health import NodeHealth

    r, env = res.cfg.resiliency, res.env
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    store_factory, store_kwargs, base_store = _stores(env.world_size, env.rank)
    logfile = (Path(res.cfg.train.run_dir) / "logs" / "inprocess_monitor_{rank}.log").resolve()
    logfile.parent.mkdir(parents=True, exist_ok=True)
    s = lambda seconds: datetime.timedelta(seconds=seconds)  # noqa: E731
    barrier_s = r.hard_timeout_s + r.termination_grace_s + BARRIER_MARGIN_S
    aborts: list[tuple[str, Any]] = [("torch.distributed", _DistributedAbort(inprocess.abort.AbortTorchDistributed))]
    callbacks: dict[str, Any] = {}
    if layers.heartbeat.active:  # both layers on: tell ft_launcher about in-process restarts (first, as Compose did)
        aborts.insert(0, ("nested restarter", nested.NestedRestarterHandlingStarting()))
        callbacks = dict(initialize=nested.NestedRestarterHandlingCompleted(),
                         completion=nested.NestedRestarterFinalized(),
                         terminate=nested.NestedRestarterAborted())

    class TimedAbort(inprocess.abort.Abort):
        """The abort, timed for the restart's phases (``trainer.startup.phases``), each part's seconds logged."""

        def __call__(self, state: Any) -> Any:
            phases.CLOCK.note("abort_began")
            took = []
            try:
                for name, part in aborts:
                    began = time.perf_counter()
                    state = part(state)
                    took.append(f"{name} {time.perf_counter() - began:.3f} s{getattr(part, 'detail', '')}")
                return state
            finally:
                phases.CLOCK.note("abort_ended")
                log.info("in-process abort: %s", ", ".join(took) or "did not finish")
                clock.start()

    checks = inprocess.Compose(  # run() checked the node at start: that covers the first iteration
        NodeHealth(layers.health, checked_for=0),
        inprocess.health_check.FaultCounter(max_rank_faults=r.inprocess_max_restarts),
    )
    clock = _WrapperClock()

    class TimedHealthCheck(inprocess.health_check.HealthCheck):
        def __call__(self, state: Any) -> Any:
            began = time.perf_counter()
            try:
                return checks(state)
            finally:
                clock.health_s += time.perf_counter() - began

    def restartable(call_wrapper: inprocess.CallWrapper = None) -> dict[str, Any]:
        phases.CLOCK.note("called_again")
        if call_wrapper.iteration:
            log.info("in-process restart, from the abort's end to this call: %s", clock.stop(phases.CLOCK.marks))
        if layers.preemption.committed:  # interrupted after the final checkpoint (a peer already left): done
            raise TrainerExit(ExitCode.PREEMPTED, "preempted: the final checkpoint was committed before this restart")
        if call_wrapper.iteration > r.inprocess_max_restarts:
            raise TrainerExit(ExitCode.RESTART_BUDGET_EXHAUSTED,
                              f"in-process restart budget spent ({r.inprocess_max_restarts} restarts)")
        if int(os.environ["WORLD_SIZE"]) != env.world_size:
            raise TrainerExit(ExitCode.RANKS_LOST,
                              f"world shrank to {os.environ['WORLD_SIZE']} of {env.world_size} ranks; "
                              "the in-job or cluster layer restarts the whole group")
        layers.call_wrapper = call_wrapper
        layers.heartbeat.start()
        store = dist.PrefixStore(str(call_wrapper.iteration), base_store)
        return _call(train_fn, res, store, layers)

    wrapped = inprocess.Wrapper(
        store_factory=store_factory,
        store_kwargs=store_kwargs,
        abort=TimedAbort(),
        health_check=TimedHealthCheck(),
        soft_timeout=s(r.soft_timeout_s),
        hard_timeout=s(r.hard_timeout_s),
        heartbeat_timeout=s(r.heartbeat_timeout_s),
        barrier_timeout=s(barrier_s),
        completion_timeout=s(barrier_s),
        termination_grace_time=s(r.termination_grace_s),
        monitor_process_interval=s(r.monitor_process_interval_s),
        progress_watchdog_interval=s(r.progress_watchdog_interval_s),
        last_call_wait=s(r.last_call_wait_s),  # FT: a sleep on every in-process restart's path (NVRx default 1 s)
        monitor_process_logfile=str(logfile),
        **callbacks,
    )(restartable)
    try:
        return wrapped()
    finally:
        layers.call_wrapper = None


class _WrapperClock:
    """What of an in-process restart's ``wrapper`` phase (from the abort's end to the function's next call:
    ``phases.CLOCK``'s marks) went to the Wrapper's health checks (after the fault, and again on entering the next
    iteration) and to its garbage collection (``while gc.collect()`` on every restart); the rest is its store
    barriers, the monitor thread's shutdown and the nested restarter's callbacks."""

    def __init__(self) -> None:
        self.health_s = self.gc_s = 0.0
        self.collections = 0
        self._gc_began: float | None = None

    def start(self) -> None:
        self.health_s, self.gc_s, self.collections = 0.0, 0.0, 0
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self, marks: dict[str, float]) -> str:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        total = marks["called_again"] - marks["abort_ended"] if "abort_ended" in marks else float("nan")
        return (f"{total:.3f} s: health checks {self.health_s:.3f} s, garbage collection {self.gc_s:.3f} s "
                f"({self.collections} collections), the rest {total - self.health_s - self.gc_s:.3f} s")

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.gc_s += time.perf_counter() - self._gc_began
            self.collections += 1
            self._gc_began = None
