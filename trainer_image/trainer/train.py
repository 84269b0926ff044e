"""The training loop: one short, flat loop; policies live in the objects that own them.

``Resources`` are built once per process (they hold no process-group state and survive in-process restarts);
``train()`` is the restartable function: it (re)builds the process group, the sharded model and optimizer,
restores the latest state and runs steps until ``train.steps``.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from trainer import parallel, resiliency
from trainer.checkpoint import CheckpointManager, committed_steps, premap
from trainer.config import ConfigError, JobConfig, OptimConfig, accumulation, keep_global_batch
from trainer.data import VERIFIED_FILE, ShardedTokens, TokenLoader
from trainer.exitcodes import TrainerExit
from trainer.hf import BaseModel
from trainer.metrics import MetricsLogger, peak_bf16_flops
from trainer.model import Transformer, count_params, flops_per_token
from trainer.optimizer import ADAMW_OPTIONS, LocalShardAdamW, adamw_implementation
from trainer.profiling import StepProfiler
from trainer.resiliency import device as device_handover
from trainer.startup import phases, warmup

log = logging.getLogger(__name__)


@dataclass
class Resources:
    """Process-group-independent things, built once per process and reused by every (re)start of ``train``."""

    cfg: JobConfig
    env: parallel.DistEnv
    device: torch.device
    dataset: ShardedTokens
    metrics: MetricsLogger
    checkpointer: CheckpointManager
    """One per process: its background writer and host staging buffers survive in-process restarts."""
    base_model: BaseModel | None = None
    """``model.from_hf`` (its weights are read only when training starts fresh), or None."""
    started_at: float = field(default_factory=time.time)
    warm: bool = False
    """A training step ran in this process: the allocator's cache and the kernels are warm."""
    warmup: warmup.InBackground | None = None
    """``resiliency.start_warmup`` running beside this new process's start; joined before its first step."""

    def start_warmup(self) -> None:
        """A new worker's warm-up in the background (``trainer/startup/warmup.py``), once its device is chosen."""
        self.warmup = warmup.for_new_worker(self.cfg, self.device, self.env.world_size)

    @classmethod
    def create(cls, cfg: JobConfig, env: parallel.DistEnv | None = None) -> "Resources":
        env = env or parallel.DistEnv.from_environ()
        node_range = os.environ.get("TRAINER_NODE_RANGE")  # entrypoint.sh: the sizes the job may shrink and grow to
        note = keep_global_batch(cfg.train, node_range, env.local_world_size) if node_range else None
        if note and env.rank == 0:
            log.info("%s", note)
        accumulation(cfg.train, env.world_size)  # a global batch this world size cannot take: one line, exit 2
        device_handover.install()  # FT: a child forked from this worker never keeps its device memory alive
        if parallel.wants_cuda(cfg.train):  # FT: a context's room now, the whole need before the model (train())
            device_handover.wait_for_predecessor(env.local_rank, cfg.resiliency.device_wait_s,
                                                 "its previous worker's memory is being released",
                                                 at_most=device_handover.CONTEXT_ROOM)
        device = parallel.select_device(cfg.train, env)
        cfg.resiliency.check_collective_timeout(parallel.backend_for(device))
        if cfg.train.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            deterministic_algorithms(compiled=cfg.train.compile)
        base_model = BaseModel.for_model(cfg.model, env.local_rank)  # model.from_hf: the shape from its config.json
        # FT: hashed once per job, not at every worker (re)start: later starts skip the files verified before
        dataset = ShardedTokens(cfg.data.path, split="train", verify=cfg.data.verify_checksums,
                                verified=Path(cfg.train.run_dir) / VERIFIED_FILE)
        if base_model is not None:
            base_model.check_data(dataset.path, dataset.vocab_size, cfg.model.vocab_size,
                                  dataset.manifest.get("tokenizer", "tokenizer.json"))
        elif cfg.model.vocab_size == 0:
            cfg.model.vocab_size = dataset.vocab_size
        elif cfg.model.vocab_size < dataset.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the dataset's vocabulary "
                f"({dataset.vocab_size}); set --model.vocab_size=0 to take it from the dataset"
            )
        metrics = MetricsLogger(cfg.train.run_dir, enabled=env.is_main)
        r = cfg.resiliency
        checkpointer = CheckpointManager(
            cfg.checkpoint, cfg.checkpoint_dir, env, config_json=cfg.to_json(),
            # FT: its gloo collectives cannot be aborted: keep them below the in-process soft timeout.
            coordination_timeout_s=min(r.collective_timeout_s, r.soft_timeout_s / 2) if r.inprocess else r.collective_timeout_s,
        )
        if base_model is not None and not (cfg.checkpoint.resume and committed_steps(cfg.checkpoint_dir)):
            base_model.fetch_weights()  # a URI: downloaded now, outside the restartable train(), unless resuming
        return cls(cfg=cfg, env=env, device=device, dataset=dataset, metrics=metrics, checkpointer=checkpointer,
                   base_model=base_model)

    def close(self, job_over: bool = False) -> None:
        """End of the process: stop the checkpoint writer (idempotent; also runs at interpreter exit).
        ``job_over`` (finished, or a permanent error) also removes the node-local snapshots."""
        self.checkpointer.close(job_over=job_over)


class TrainProgress:
    """Step counter and RNG states (CPU and CUDA, per rank): the part of a restart that is not a tensor shard."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])


def build_model(cfg: JobConfig, device: torch.device) -> nn.Module:
    """Full deterministic init on the target device (same weights for any world size), then FSDP2 sharding (one
    rank: ``OneRank``, which clips at ``optim.grad_clip`` when each backward ends; see ``parallel.clip_grad_norm_``)."""
    with torch.device(device):
        model = Transformer(cfg.model, max_seq_len=cfg.data.seq_len)
    model.init_weights(cfg.train.seed)
    return parallel.apply_fsdp(model, cfg.train, device, grad_clip=cfg.optim.grad_clip)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "tok_embeddings" in n]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    one_rank = getattr(model, "_one_rank", None)
    options = ADAMW_OPTIONS[adamw_implementation(cfg, next(model.parameters()).device, one_rank=one_rank is not None)]
    if options.get("triton") and one_rank is not None:  # it reads the compute-dtype gradients itself
        options = {**options, "handed": one_rank.hand_over_gradients()}
    # FT: stepped on the local shards: AdamW over DTensors leaks host memory per step on torch 2.10/2.11, which every
    # in-process restart's full garbage collections then scan (optimizer.py)
    return LocalShardAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **options)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps`` (1-based step)."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def global_mean(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().float().clone()
    if world_size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / world_size


def train(
    res: Resources, store: dist.Store | None = None, ft: resiliency.Layers | None = None
) -> dict[str, Any]:
    """Run (or resume) training up to ``train.steps``; returns the summary. Restartable in-process."""
    cfg, env, device = res.cfg, res.env, res.device
    ft = ft or resiliency.NULL()  # FT: recovery layers (resiliency.run); all no-ops when called directly
    phases.CLOCK.entered_train()  # FT: phases of this (re)start, logged at its first step
    if phases.CLOCK.reentry and device.type == "cuda":  # FT: what the failed attempt left allocated (its model?)
        log.info("in-process restart: %.2f GiB of device memory allocated at the re-entry of train() (peak so far "
                 "%.2f GiB)", torch.cuda.memory_allocated(device) / 2**30, torch.cuda.max_memory_allocated(device) / 2**30)
        device_handover.wait_for_predecessor(env.local_rank, cfg.resiliency.device_wait_s, "after an in-process restart")
    parallel.init_process_group(device, env, cfg.resiliency.collective_timeout_s, store)
    if not phases.CLOCK.reentry and device.type == "cuda":  # FT: the process group was made meanwhile
        device_handover.wait_for_predecessor(env.local_rank, cfg.resiliency.device_wait_s,
                                             "its previous worker's memory is being released, before the model's build")
    checkpointer = res.checkpointer
    checkpointer.event_sink = ft.record  # FT: the automatic checkpoint interval goes into the recovery ledger
    checkpointer.keepalive = ft.keepalive  # FT: a slow disk during a blocking save is not a hung rank
    state: dict[str, Any] | None = None
    try:
        checkpointer.bind()  # FT: per attempt: the new process group; a write left in flight goes on in the background
        phases.CLOCK.mark("process_group")

        def fresh() -> dict[str, Any]:
            model = build_model(cfg, device)
            loader = TokenLoader(res.dataset, cfg.data.seq_len, cfg.train.batch_size, env.rank, env.world_size,
                                 cfg.data.seed, accumulation=accumulation(cfg.train, env.world_size))
            return {"model": model, "optimizer": build_optimizer(model, cfg.optim), "progress": TrainProgress(),
                    "dataloader": loader, "ft": ft.ft_state}  # FT: heartbeats' learned timeouts are checkpointed

        state = fresh()
        phases.CLOCK.mark("model")
        # FT: memory, then node-local, then disk; a new GPU process warms up while the snapshot is copied in; a
        # step given up after it was copied in leaves a state built afresh
        restored = checkpointer.load_latest(state, while_copying=_warmup(res, lambda: state["model"]), fresh=fresh)
        model, optimizer, loader, progress = state["model"], state["optimizer"], state["dataloader"], state["progress"]
        if restored is None and res.base_model is not None:
            res.base_model.load_into(model)  # a fresh start from model.from_hf: this rank's shards only
        phases.CLOCK.mark("restore")
        if res.warmup is not None:  # FT: what it has not finished, the start waits for (phase warm), not step 1
            log.info("start warm-up: %s", res.warmup.wait())
            res.warmup = None
            phases.CLOCK.mark("warm")
        summary = _loop(res, model, optimizer, loader, progress, checkpointer, state, ft)
    except BaseException as exc:
        phases.CLOCK.note("left_train")  # FT: the in-process restart's phases (startup/phases.py)
        if cfg.resiliency.inprocess and isinstance(exc, Exception) and not isinstance(exc, TrainerExit):
            checkpointer.snapshot_at_fault(state)  # FT: the last whole step, for the in-process restart (atfault.py)
        # FT: on gloo (CPU) the rank that leaves closes its sockets first, so a peer blocked in a gloo collective
        # (which cannot be aborted) is released at once instead of at the collective timeout, and the in-process
        # restart beats the in-job one. NCCL is left to the in-process layer's abort (see below).
        if parallel.backend_for(device) == "gloo":
            parallel.abort_process_group()
        raise
    finally:
        checkpointer.unbind()  # FT: no collectives here: after a fault the process group may be broken
    # FT: only a clean finish destroys the process group here. After a fault the in-process layer aborts and
    # destroys it; destroying a NCCL group while a peer is blocked in a collective hangs this rank before the
    # Wrapper hears of the fault (seen on H200: the peer then waited for the soft timeout).
    parallel.destroy_process_group()
    return summary


def warm_up_step(model: nn.Module, batch_size: int, seq_len: int, device: torch.device) -> None:
    """One forward and backward on a dummy batch, gradients dropped: it changes no parameter, optimizer state, RNG
    stream or data position, only what is warm (the allocator's cache, cuBLAS handles, loaded kernels, FSDP's lazy
    initialisation)."""
    tokens = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
    with torch.enable_grad():  # the restore copies under no_grad
        model(tokens, tokens).backward()
    model.zero_grad(set_to_none=True)


def _warmup(res: Resources, model: Callable[[], nn.Module]) -> Any:
    """``resiliency.restore_warmup``: ``warm_up_step`` while the snapshot is copied in, for a new GPU process (its
    first real step then finds everything warm); None otherwise. It only reads the parameters the restore writes on
    its own stream."""
    cfg, device = res.cfg, res.device
    if res.warm or device.type != "cuda" or not cfg.resiliency.restore_warmup:
        return None

    def warm_up() -> None:
        if res.warm:  # a second snapshot tried after the first failed its check: warm already (on every rank)
            return
        # FT: a standby's worker whose slots the standby page-locked ahead: the kernels are loaded, the copy usually
        # short (the newest snapshot's slot may not be among those locked yet: a restart soon after the last one)
        if warmup.STANDBY_WARMED and sum(premap.TAKEN):
            log.info("warm-up skipped: this worker's standby prewarmed it and page-locked %.1f GiB of its node-local "
                     "snapshots ahead", sum(premap.TAKEN) / 2**30)
            return
        started = time.perf_counter()
        warm_up_step(model(), cfg.train.batch_size, cfg.data.seq_len, device)
        res.warm = True
        log.info("warm-up forward and backward (discarded) issued in %.2f s while the snapshot was copied in",
                 time.perf_counter() - started)

    return warm_up


def deterministic_algorithms(compiled: bool) -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)``. Without ``torch.compile`` the flag is set without
    the public function's import of Inductor's config (0.5 s of CPU per process, every trainer start of a CPU run)
    when this torch has the setter, and Inductor is not loaded already (its flag is then set too)."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if compiled or setter is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        setter(True, warn_only=True)


class GarbageCollection:
    """Python's automatic collector off for the loop, a young-generation collection every ``every`` steps
    instead (as torchtitan does): an automatic collection can land in any step and stall it. 0: left alone."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.was_enabled = gc.isenabled()

    def __enter__(self) -> "GarbageCollection":
        if self.every:
            gc.disable()
            gc.collect(1)
        return self

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc: object) -> None:
        if self.every and self.was_enabled:
            gc.enable()


def _loop(res: Resources, *args: Any) -> dict[str, Any]:
    """The step loop (``_steps``) under the garbage-collection policy of ``train.gc_every``, profiled over
    ``train.profile_steps``."""
    profiler = StepProfiler(res.cfg.train.profile_steps, res.cfg.train.run_dir, res.env.rank, res.device)
    try:
        with GarbageCollection(res.cfg.train.gc_every) as collector:
            summary = _steps(res, *args, collector=collector, profiler=profiler)
    except BaseException:
        profiler.discard()  # a failed attempt: no device sync (it may hang), no trace
        raise
    profiler.close()
    return summary


def _steps(
    res: Resources,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: TokenLoader,
    progress: TrainProgress,
    checkpointer: CheckpointManager,
    state: dict[str, Any],
    ft: resiliency.Layers,
    collector: GarbageCollection,
    profiler: StepProfiler,
) -> dict[str, Any]:
    cfg, env, device = res.cfg, res.env, res.device
    accum = loader.accumulation
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * env.world_size * accum
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    peak = peak_bf16_flops(device)
    first_step = progress.step + 1
    samples = Path(cfg.train.run_dir) / "samples" / f"rank-{env.rank}.jsonl" if cfg.data.sample_log else None
    if samples:
        samples.parent.mkdir(parents=True, exist_ok=True)
        loader.served = []
    if progress.step == 0:
        res.metrics.log(
            {"event": "start", "world_size": env.world_size, "device": str(device),
             "params": count_params(cfg.model), "tokens_per_step": tokens_per_step, "accumulation": accum,
             "model": cfg.model.name,
             "checkpoint": {"interval": cfg.checkpoint.interval, "persist_every": cfg.checkpoint.persist_every,
                            "node_local": cfg.checkpoint.node_local,  # read by the planner (trainer.planning.ledgers)
                            "replicas": checkpointer.replicas.count if checkpointer.replicas is not None else 0}}
        )
    else:
        res.metrics.log({"event": "resume", "step": progress.step, "world_size": env.world_size,
                         "accumulation": accum, "tokens_per_step": tokens_per_step})
    loss = torch.zeros((), device=device)
    t_last, steps_since_log = time.perf_counter(), 0
    # FT: ledger: start, or which layer restarted us (a node that joined: ``node``) and where each rank resumed from
    ft.on_loop_start(progress.step, checkpointer.restored_from, gather=checkpointer.coord.all_gather,
                     read=checkpointer.bytes_read)
    for step in range(first_step, cfg.train.steps + 1):
        profiler.step(step)
        collector.step(step)
        checkpointer.before_step(step)  # a snapshot's drain to host memory: the next part, behind the last step's work
        ft.before_step(step)  # FT: progress ping (in-process), heartbeat (in-job), fault injection
        lr = lr_at(step, cfg.optim, cfg.train.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with ft.section("data"):  # FT: straggler detection times the step's parts (NVRx detection_section)
            inputs, targets = (t.to(device, non_blocking=True) for t in loader.next_batch())
        with ft.section("forward_backward"):  # FT: holds FSDP's collectives: waits for peers land here
            if accum == 1:
                loss = model(inputs, targets)  # the logits die inside: none stay alive into the next forward
                loss.backward()
            else:  # the other micro-batches' data is read in this section
                loss = _accumulate(model, loader, inputs, targets, accum, device)
            grad_norm = None
            if cfg.optim.grad_clip > 0:
                grad_norm = parallel.clip_grad_norm_(model, cfg.optim.grad_clip)
        checkpointer.wait_for_staging()  # async-safety: the previous save's staging must be done
        checkpointer.whole.updating()  # FT: a fault from here to the mark leaves no whole step to snapshot
        with ft.section("optimizer"):  # FT: local work only, like data
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        res.warm = True
        progress.step = step
        checkpointer.whole.mark(step, state)  # FT: the step a fault before the next update snapshots (atfault.py)
        if samples:  # data.sample_log: which samples this rank trained in this step
            with samples.open("a") as f:
                f.write(json.dumps({"step": step, **loader.take_served()}) + "\n")
        steps_since_log += 1
        last_step = step == cfg.train.steps
        saved = False
        if not last_step:  # before the log's sync: the snapshot's host work overlaps this step's queued kernels
            with ft.atomic(), profiler.label("checkpoint.save"):  # FT: a restart never interrupts a commit
                saved = checkpointer.save(step, state)
        if step % cfg.train.log_every == 0 or last_step:
            loss_value = global_mean(loss, env.world_size)
            if device.type == "cuda":  # the training stream: a snapshot's drain to host memory goes on beside it
                torch.cuda.current_stream(device).synchronize()
            now = time.perf_counter()
            step_time = (now - t_last) / steps_since_log
            t_last, steps_since_log = now, 0
            res.metrics.log(
                {
                    "event": "step",
                    "step": step,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": _to_float(grad_norm),
                    "step_time_s": step_time,
                    "tokens_per_s": tokens_per_step / step_time,
                    "mfu": flops_per_step / step_time / (peak * env.world_size) if peak else None,
                    **_peak_memory(device),
                }
            )
        if last_step:  # after the step's line: the final save (synchronous, to disk) is not a step's time
            with ft.atomic():
                saved = checkpointer.save(step, state, last_step=True)
        ft.after_step(step, checkpointer, state, saved)  # FT: timeouts, ledger, SIGTERM -> final save + exit
    summary = {
        "event": "summary",
        "steps": progress.step,
        "tokens": progress.step * tokens_per_step,
        # an attempt that resumed at the last step trains none: no loss of its own (not the 0 it starts from)
        "final_loss": global_mean(loss, env.world_size) if first_step <= cfg.train.steps else None,
        "wall_time_s": time.time() - res.started_at,
        "world_size": env.world_size,
        "snapshot_blocking": checkpointer.blocking_figures(),  # this process's memory checkpoints, host-thread time
        # the peer tier's newest pushes to every holder (the planner's replica lag, trainer.planning.ledgers)
        "replica_push": checkpointer.replicas.push_figures() if checkpointer.replicas is not None else None,
    }
    res.metrics.log(summary)
    ft.on_train_end(progress.step)  # FT: ledger summary (goodput)
    if env.is_main:
        (Path(cfg.train.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _accumulate(model: nn.Module, loader: TokenLoader, inputs: torch.Tensor, targets: torch.Tensor, accum: int,
                device: torch.device) -> torch.Tensor:
    """One step's gradients from ``accum`` micro-batches (``train.global_batch``), the first given: each loss scaled
    by ``1/accum``, so the gradient is the global batch's mean; FSDP2 reduce-scatters once, after the last. Returns
    the step's mean loss on this rank."""
    total = torch.zeros((), device=device)
    for k in range(accum):
        if k:
            inputs, targets = (t.to(device, non_blocking=True) for t in loader.next_batch())
        parallel.set_gradient_sync(model, k == accum - 1)
        loss = model(inputs, targets) / accum
        loss.backward()
        total += loss.detach()
    return total


def _peak_memory(device: torch.device) -> dict[str, float]:
    """Peak device memory of this rank so far, in GiB (CUDA only; no host sync)."""
    if device.type != "cuda":
        return {}
    return {"mem_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
            "mem_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}


def _to_float(value: torch.Tensor | None) -> float | None:
    if value is None:
        return None
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
