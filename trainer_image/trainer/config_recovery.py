"""The recovery sections of the trainer config: ``[checkpoint]`` (the tiers every layer resumes from) and
``[resiliency]`` (the in-process layer, heartbeats to the in-job layer, fault injection). The in-job layer's own
flags live in ``entrypoint.sh``; the cluster layer's in ``components/lib``."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config_checks import ConfigError, choice as _choice, positive as _positive
from trainer.planning import PlanError, failures

KINDS = ("exception", "hang", "hang_gil", "sigkill", "oom", "sigterm", "corrupt_checkpoint", "slow", "node_lost",
         "data_error")
"""Fault kinds of ``resiliency.faults`` (injected by ``trainer.faults``); ``slow`` takes a factor (``slow:0.5``)."""
MAX_SLOW_FACTOR = 10.0
STRAGGLER_MODES = ("off", "report", "evict")


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    step: int
    kind: str
    factor: float = 0.0
    """``slow`` only: the rank sleeps this fraction of each timed part of its steps (0.5: 50 % slower)."""

    @property
    def marker_name(self) -> str:
        return f"{self.rank}-{self.step}-{self.kind}"


def parse_faults(items: list[str] | tuple[str, ...]) -> list[FaultSpec]:
    """Parse ``rank:step:kind`` items (``rank:step:slow:<factor>`` for ``slow``); a ConfigError says what to
    change."""
    specs: list[FaultSpec] = []
    for item in items:
        parts = item.strip().split(":")
        hint = (f"resiliency.faults item {item!r} must look like rank:step:kind, e.g. 1:5:exception "
                "(or rank:step:slow:<factor>, e.g. 1:5:slow:0.5)")
        if len(parts) == 4 and parts[2].strip() == "slow":
            factor = _slow_factor(parts[3].strip(), hint)
            parts = parts[:3]
        elif len(parts) == 3 and parts[2].strip() == "slow":
            raise ConfigError(f"{hint}; slow needs a factor, the fraction of its step the rank sleeps")
        else:
            factor = 0.0
        if len(parts) != 3:
            raise ConfigError(hint)
        rank_s, step_s, kind = (p.strip() for p in parts)
        try:
            rank, step = int(rank_s), int(step_s)
        except ValueError:
            raise ConfigError(f"{hint}; rank and step must be integers") from None
        if rank < 0:
            raise ConfigError(f"{hint}; rank must be >= 0, got {rank}")
        if step < 1:
            raise ConfigError(f"{hint}; step must be >= 1 (steps count from 1), got {step}")
        if kind not in KINDS:
            raise ConfigError(f"{hint}; unknown kind {kind!r}, kinds are {list(KINDS)}")
        spec = FaultSpec(rank, step, kind, factor)
        if any((s.rank, s.step) == (rank, step) for s in specs):
            raise ConfigError(f"resiliency.faults has two faults for rank {rank} at step {step}; keep one")
        specs.append(spec)
    return specs


def _slow_factor(text: str, hint: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        raise ConfigError(f"{hint}; the slow factor must be a number, got {text!r}") from None
    if not 0 < factor <= MAX_SLOW_FACTOR:
        raise ConfigError(f"{hint}; the slow factor must be in (0, {MAX_SLOW_FACTOR:g}] (0.5: 50 % slower), got {text}")
    return factor



@dataclass
class CheckpointConfig:
    dir: str = ""
    """Checkpoint directory on shared storage; empty = ``<train.run_dir>/checkpoints``."""
    interval: int | str = 0
    """Memory checkpoint every N steps (a snapshot in host memory: it blocks only for the device-to-host copy);
    ``"auto"`` chooses N by Young/Daly, sqrt(2 * measured snapshot cost * MTBF), logged and recorded in
    the recovery ledger (the cost: the extra time of the 4 steps after a snapshot, where a GPU's staging copies
    and drain land); 0 checkpoints only at the end of the run."""
    persist_every: int = 1
    """Every N-th memory checkpoint is also written to ``dir`` in the background (the persistent tier, read by
    evaluation, the cluster layer and new nodes); 1 persists every one, 0 only the final one. One that falls due
    while the previous write is still running goes with the next memory checkpoint that finds the writer free (the
    log says when the disk falls behind, and by how much)."""
    memory_slots: int | str = "auto"
    """Snapshot slots per rank in host memory (each holds this rank's whole state). Only the slot being persisted
    is held. With 2 and a write in flight, the newest snapshot is restaged while the one being written is its only
    fallback: a fault in that window (a large state takes many steps to write) restores a snapshot as old as the
    write. With 3, two slots take turns beside the one being
    written, so a fault at any step restores the newest snapshot taken 2 or more steps before it. ``auto``: 3 where
    the node's memory holds them (``hostmem``), else 2, said in one line. A memory checkpoint is never skipped
    because the disk is slow."""
    snapshot_at_fault: bool = True
    """An exception or a hang outside ``optimizer.step()`` leaves the last finished step whole in memory: the failed
    attempt's end stages it into a free slot, so the in-process restart resumes from it instead of the last memory
    checkpoint, where that saves 2 or more steps (``trainer/checkpoint/atfault.py``)."""
    node_local: bool = True
    """Publish each snapshot on the node (a header with a checksum beside the slot file) so a worker respawned
    on the same node resumes from it instead of the disk."""
    node_local_dir: str = "/dev/shm"
    """Memory-backed directory for the snapshot slots (a memory ``emptyDir`` in Kubernetes); ``entrypoint.sh``
    gives each job its own subdirectory and removes it when the job ends."""
    replicas: int | str = "auto"
    """Peer tier: each rank's newest snapshot is also copied, in the background and from its slot's file, into the
    host memory (``node_local_dir``) of a rank on each of the next N nodes (``checkpoint/replicas.py``), so a lost
    node's ranks restore from memory instead of ``dir``. ``auto``: 1 where the job has 2 or more nodes, else 0;
    more than the other nodes is capped at them. A holder mirrors the slots (``memory_slots``) of each rank it holds for,
    so the node-local directory holds ``(1 + replicas) * memory_slots`` states per rank (checked at start)."""
    device_staging: str = "auto"
    """CUDA: copy a snapshot first into a device buffer laid out like its slot (device-to-device, ~10 ms for 18 GB)
    and drain that buffer to host memory in the background, so the next ``optimizer.step()`` waits only for the
    device-to-device copy. ``auto``: when the device's free memory after the first steps holds the buffer (this
    rank's whole state) with a margin (logged once); ``on``: always (warns and copies directly when it does not
    fit); ``off``: device-to-host copies that the step waits for. Ignored on CPU."""
    pin_chunk_mib: int = 1024
    """CUDA: page-lock each snapshot slot in registrations of this many MiB, pausing after each as long as it took
    (copies into and out of the slot are split at their boundaries); 0: one registration per slot. Registering an
    18 GB slot in one call holds the CUDA driver for seconds, and the training thread's kernel launches wait: with 0,
    the first step after an in-job restart takes seconds more on an H200. 1024
    matches the chunks a node-local restore registers, which are then kept instead of registered again."""
    mtbf_s: float = 0.0
    """Mean time between failures of the whole job, for ``interval = "auto"``; 0: the MTBF of ``failure_model`` at
    the job's real size (one GPU a rank: the world size), as the goodput planner computes it (``trainer.planning``)."""
    failure_model: str = "llama3"
    """The failure model ``interval = "auto"`` uses when ``mtbf_s`` is 0: ``llama3`` (Llama 3's 54 days on 16,384
    H100s), ``rsc1``, ``rsc2`` (Meta's research clusters), or a JSON file of rates per GPU-hour
    (``trainer/PLANNING.md``)."""
    keep: int = 2
    """Committed checkpoints to keep (>= 2 so a corrupt newest one can fall back)."""
    async_save: bool = True
    """Write in the background; training blocks only while the state is staged in host memory."""
    final_cancels_older_write: bool = True
    """The final save (last step, preemption) cancels a write of an older step still in flight and writes only its
    own state: one state written, the shortest final save. False waits for that write to commit first (every
    periodic checkpoint kept, e.g. for an evaluation that reads them), then writes its own."""
    resume: bool = True
    """Resume from the latest valid checkpoint in ``dir`` when one exists."""
    init_from: str = ""
    """Warm start: load model weights (not optimizer or step) from this checkpoint dir when ``dir`` is empty."""
    verify_checksums: bool = True
    """Verify the sha256 of every 64 MiB chunk of the shards a rank reads, with a thread pool while reading them
    (one disk pass; the load then reads from the page cache)."""
    min_write_mbps: float = 20.0
    """The slowest storage a blocking save (the final one, a preemption's) is waited for, in MB/s per rank: the
    rank's liveness signals (in-job heartbeat, in-process ping) go on for 30 s plus its shard's bytes at this rate,
    then stop, and the recovery layers take a write that has not finished by then for a hung disk."""

    def validate(self) -> None:
        if isinstance(self.interval, str) and self.interval.strip().isdigit():
            self.interval = int(self.interval)
        if self.interval != "auto" and not (isinstance(self.interval, int) and self.interval >= 0):
            raise ConfigError(
                f"checkpoint.interval must be a number of steps >= 0 (0 = only the final save) or \"auto\"; "
                f"got {self.interval!r}"
            )
        _choice(self, "checkpoint", "device_staging", ("auto", "on", "off"))
        if isinstance(self.replicas, str) and self.replicas.strip().isdigit():
            self.replicas = int(self.replicas)
        if self.replicas != "auto" and not (isinstance(self.replicas, int) and self.replicas >= 0):
            raise ConfigError(f"checkpoint.replicas must be a number of other nodes >= 0 (0 = no peer tier) or "
                              f"\"auto\" (1 with 2 nodes or more); got {self.replicas!r}")
        if self.persist_every < 0:
            raise ConfigError(f"checkpoint.persist_every must be >= 0 (0 = only the final save); got {self.persist_every}")
        if isinstance(self.memory_slots, str) and self.memory_slots.strip().isdigit():
            self.memory_slots = int(self.memory_slots)
        if self.memory_slots != "auto" and not (isinstance(self.memory_slots, int) and self.memory_slots >= 2):
            raise ConfigError(
                f"checkpoint.memory_slots must be >= 2 so the newest snapshot stays valid while the next is staged, "
                f"or \"auto\" (3 where host memory allows, else 2); got {self.memory_slots!r}"
            )
        if self.pin_chunk_mib < 0:
            raise ConfigError(f"checkpoint.pin_chunk_mib must be >= 0 (0 = one registration per slot); got {self.pin_chunk_mib}")
        if self.mtbf_s < 0:
            raise ConfigError(f"checkpoint.mtbf_s must be >= 0 (0: from checkpoint.failure_model); got {self.mtbf_s}")
        try:
            failures.load(self.failure_model)
        except PlanError as exc:
            raise ConfigError(f"checkpoint.failure_model: {exc}") from None
        if self.min_write_mbps <= 0:
            raise ConfigError(f"checkpoint.min_write_mbps must be > 0 (MB/s); got {self.min_write_mbps}")
        if self.keep < 2:
            raise ConfigError(
                f"checkpoint.keep must be >= 2 so a corrupt latest checkpoint can fall back; got {self.keep}"
            )



@dataclass
class ResiliencyConfig:
    inprocess: bool = False
    """In-process restart layer: wrap training in NVRx ``inprocess.Wrapper`` (exceptions and hangs are
    recovered in the same processes). On CPU/gloo it needs ``collective_timeout_s < soft_timeout_s``."""
    inprocess_max_restarts: int = 3
    """In-process restarts allowed per process (and faults per rank, NVRx ``FaultCounter``); beyond it the
    process exits RESTART_BUDGET_EXHAUSTED (200) and the in-job layer takes over."""
    heartbeats: str = "auto"
    """In-job layer: NVRx ``RankMonitorClient`` heartbeats to ``ft_launcher``: ``auto`` (on when launched
    by ft_launcher), ``on`` (error without ft_launcher) or ``off``."""
    soft_timeout_s: float = 60.0
    """In-process: a rank that made no progress (no step) for this long is interrupted and restarted."""
    hard_timeout_s: float = 90.0
    """In-process: a rank stuck this long (e.g. GIL held) is terminated; the in-job layer then restarts
    the group. Keep ``ft_launcher``'s heartbeat timeout above it (``entrypoint.sh``)."""
    heartbeat_timeout_s: float = 30.0
    """In-process: a rank whose monitor sends no heartbeat for this long is declared missing."""
    termination_grace_s: float = 5.0
    """In-process: seconds between SIGTERM and SIGKILL when the hard timeout terminates a rank."""
    monitor_process_interval_s: float = 0.5
    """In-process: how often the monitor process checks timeouts; must be < ``progress_watchdog_interval_s``
    (NVRx skips timeout checks while watchdog timestamps keep arriving)."""
    progress_watchdog_interval_s: float = 1.0
    """In-process: how often the progress watchdog reports a timestamp to the monitor process."""
    restore_warmup: bool = True
    """GPU: while a new process copies its snapshot in (node-local tier), one forward and backward on a dummy batch
    (discarded) warm the CUDA caching allocator, cuBLAS and the kernels its first real step would otherwise wait
    for. It runs inside the recovery time the ledger measures; the RNG and data position are restored after it.
    Skipped in a standby's worker whose snapshot slots the standby page-locked ahead (``standby_premap``): its
    copy is short and its kernels are loaded: there, on an H200 (``1b``), the warm-up made the in-job restart
    longer, and the second step paid back much of what it saved the first."""
    start_warmup: bool = True
    """GPU, eager: a new worker loads its first step's kernels (one bare block at the run's shapes, the loss, the
    optimizer's kernel) in a background thread while it builds its model and restores, and waits for it before the
    first step (start phase ``warm``) instead of paying for them in that step (``trainer/startup/warmup.py``): a step 1
    like the others, the start as a whole as long as without (BENCHMARKS.md, "First step of a new worker"). Skipped
    in a standby's worker (``standby_prewarm`` did it), for a compiled run, and on the CPU."""
    standby_prewarm: bool = True
    """GPU, with warm standby workers (``TRAINER_STANDBY`` in ``entrypoint.sh``): a standby runs the same warm-up as
    ``start_warmup`` at small shapes (one block, vocabulary <= 4096, one sequence of 512 tokens) before it is needed,
    so the worker it becomes finds the kernels loaded (``trainer/startup/warmup.py``). Skipped when the device has
    less than twice its estimated memory free beside the running worker."""
    standby_premap: bool = True
    """GPU, with warm standby workers: a standby maps and page-locks the node-local snapshot slots of the worker it
    may replace (the same pages: no extra memory), in the background at the lowest priority, so that an in-job
    restore copies them at once instead of page-locking them first (``trainer/checkpoint/premap.py``)."""
    device_wait_s: float = 120.0
    """GPU: how long a worker that takes over a local rank (a warm standby or a fresh process) waits for the device
    memory its dead predecessor still holds (the peak it recorded: ``trainer/resiliency/device.py``) before its first
    allocation; past it, the node is taken for unhealthy (exit 201). A killed worker's memory comes back seconds
    after its death."""
    last_call_wait_s: float = 0.1
    """In-process: once a rank reported a fault, how long every rank waits for others to report theirs before it
    aborts and restarts. Every in-process restart pays it; it only decides which ranks the restart's log line names
    (which ranks restart does not depend on it). NVRx's default is 1 s; 0 restarts at once."""
    collective_timeout_s: float = 30.0
    """Process-group (collective) timeout. With ``inprocess`` on CPU/gloo it must stay below
    ``soft_timeout_s``: a blocked gloo collective cannot be aborted, only timed out."""
    health_checks: bool = True
    """Check GPU (NVML: ECC, retired pages, XID, thermal), NVLink and NIC health at start and after each
    in-process fault; an unhealthy rank exits UNHEALTHY_NODE (201). Absent hardware is skipped."""
    sysfs_root: str = "/sys"
    """Root of the sysfs tree the NIC health check reads (``class/net``, ``class/infiniband``); for tests."""
    preemption_grace_s: float = 25.0
    """On SIGTERM: seconds allowed for the final synchronous checkpoint before the process exits anyway.
    Keep it below the pod's ``terminationGracePeriodSeconds`` (Kubernetes default 30)."""
    straggler: str = "report"
    """Straggler detection (NVRx ``straggler.Detector`` times each rank's data, forward/backward and optimizer
    sections): ``off``; ``report`` (scores every ``straggler_report_every`` steps into metrics.jsonl,
    TensorBoard and the recovery ledger, a warning naming a rank below ``straggler_threshold``); ``evict`` (also:
    a rank below the threshold in ``straggler_patience`` reports in a row ends the job UNHEALTHY_NODE (201) after
    a checkpoint of that step, naming its host, so the cluster layer restarts the job elsewhere)."""
    straggler_report_every: int = 100
    """Steps between straggler reports (every rank reports on the same steps: a few small collectives). Each
    report scores the median section times of the steps since the previous one, so fewer than ~10 is noisy."""
    straggler_sample_every: int = 1
    """Time one step in this many for the straggler reports (NVRx's ``profiling_interval``, which NVRx advises
    raising to cut its profiling overhead: where its CUPTI extension loads, every timed step's kernels are traced).
    Must divide ``straggler_report_every``, so every report holds the same number of samples."""
    straggler_threshold: float = 0.75
    """A rank whose relative score (the fastest rank's time / its own, in (0, 1]) is below this is a straggler;
    0.75 names a rank 1.33x slower than the fastest. Between 0 and 1."""
    straggler_patience: int = 3
    """``evict``: reports in a row a rank must stay below ``straggler_threshold`` before the job is ended; one
    good report starts the count again, so one slow interval (a false alarm) evicts nothing."""
    faults: list[str] = field(default_factory=list)
    """Fault injection, ``rank:step:kind`` items (kinds: exception, hang, hang_gil, sigkill, oom, sigterm,
    corrupt_checkpoint, and ``slow:<factor>``: from that step the rank sleeps ``factor`` times the duration of
    each timed part of its step, a straggler drill). Off when empty; each fires once per run directory."""

    def validate(self) -> None:
        _choice(self, "resiliency", "heartbeats", ("auto", "on", "off"))
        _choice(self, "resiliency", "straggler", STRAGGLER_MODES)
        _positive(self, "resiliency", (
            "soft_timeout_s", "hard_timeout_s", "heartbeat_timeout_s", "termination_grace_s",
            "monitor_process_interval_s", "progress_watchdog_interval_s", "collective_timeout_s",
            "preemption_grace_s", "device_wait_s",
        ))
        if not 0 <= self.last_call_wait_s < self.soft_timeout_s:
            raise ConfigError(
                f"resiliency.last_call_wait_s must be >= 0 and smaller than resiliency.soft_timeout_s "
                f"({self.soft_timeout_s:g}); got {self.last_call_wait_s:g}"
            )
        if self.inprocess_max_restarts < 0:
            raise ConfigError(f"resiliency.inprocess_max_restarts must be >= 0; got {self.inprocess_max_restarts}")
        if self.hard_timeout_s <= self.soft_timeout_s:
            raise ConfigError(
                f"resiliency.hard_timeout_s ({self.hard_timeout_s:g}) must be greater than "
                f"resiliency.soft_timeout_s ({self.soft_timeout_s:g})"
            )
        if self.monitor_process_interval_s >= self.progress_watchdog_interval_s:
            raise ConfigError(
                f"resiliency.monitor_process_interval_s ({self.monitor_process_interval_s:g}) must be smaller than "
                f"resiliency.progress_watchdog_interval_s ({self.progress_watchdog_interval_s:g}), or NVRx skips "
                "its timeout checks; e.g. 0.5 and 1.0"
            )
        if self.progress_watchdog_interval_s >= self.soft_timeout_s:
            raise ConfigError(
                f"resiliency.progress_watchdog_interval_s ({self.progress_watchdog_interval_s:g}) must be smaller "
                f"than resiliency.soft_timeout_s ({self.soft_timeout_s:g})"
            )
        if self.inprocess and self.heartbeat_timeout_s <= self.monitor_process_interval_s:
            raise ConfigError(
                f"resiliency.heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be greater than "
                f"resiliency.monitor_process_interval_s ({self.monitor_process_interval_s:g})"
            )
        if self.straggler_report_every < 1:
            raise ConfigError(f"resiliency.straggler_report_every must be >= 1 (steps); got {self.straggler_report_every}")
        every, sample = self.straggler_report_every, self.straggler_sample_every
        if sample < 1 or every % sample:
            raise ConfigError(f"resiliency.straggler_sample_every must be >= 1 and divide "
                              f"resiliency.straggler_report_every ({every}); got {sample}")
        if not 0 < self.straggler_threshold < 1:
            raise ConfigError(
                f"resiliency.straggler_threshold must be between 0 and 1 (a rank's speed relative to the fastest, "
                f"e.g. 0.75); got {self.straggler_threshold}"
            )
        if self.straggler_patience < 1:
            raise ConfigError(f"resiliency.straggler_patience must be >= 1 (reports in a row); got {self.straggler_patience}")
        parse_faults(self.faults)

    def check_collective_timeout(self, backend: str) -> None:
        """Timeouts nest differently per backend when the in-process layer is on.

        gloo (CPU): a blocked gloo collective cannot be aborted, only timed out, so the collective timeout must
        fire before the Wrapper's soft timeout. NCCL (GPU): NVRx aborts NCCL communicators itself, and the
        NCCL watchdog would kill the whole process on a timeout, so the collective timeout must outlast the
        Wrapper's hard timeout (the in-process layer acts first).
        """
        if not self.inprocess:
            return
        if backend == "gloo" and self.collective_timeout_s >= self.soft_timeout_s:
            raise ConfigError(
                f"resiliency.collective_timeout_s ({self.collective_timeout_s:g}) must be smaller than "
                f"resiliency.soft_timeout_s ({self.soft_timeout_s:g}) on CPU/gloo with resiliency.inprocess on: a "
                "blocked gloo collective cannot be aborted, only timed out; lower collective_timeout_s (e.g. to "
                f"{max(1.0, self.soft_timeout_s / 2):g}) or raise soft_timeout_s"
            )
        if backend == "nccl" and self.collective_timeout_s <= self.hard_timeout_s:
            raise ConfigError(
                f"resiliency.collective_timeout_s ({self.collective_timeout_s:g}) must be greater than "
                f"resiliency.hard_timeout_s ({self.hard_timeout_s:g}) on GPU/NCCL with resiliency.inprocess on: "
                "NVRx aborts NCCL itself, while a NCCL timeout kills the process; raise collective_timeout_s "
                f"(e.g. to {2 * self.hard_timeout_s:g})"
            )
