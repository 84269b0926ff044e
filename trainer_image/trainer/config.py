"""Typed trainer configuration: dataclass defaults < TOML file < CLI overrides.

Each section is a dataclass and each object in the trainer receives only its own section. Every field has a
docstring (the string literal under it), which ``python -m trainer --help-config`` prints. Validation errors
say which key to change and to what.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says what to change."""


KINDS = ("exception", "hang", "hang_gil", "sigkill", "oom", "sigterm", "corrupt_checkpoint")
"""Fault kinds of ``resiliency.faults`` (injected by ``trainer.faults``)."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    step: int
    kind: str

    @property
    def marker_name(self) -> str:
        return f"{self.rank}-{self.step}-{self.kind}"


def parse_faults(items: list[str] | tuple[str, ...]) -> list[FaultSpec]:
    """Parse ``rank:step:kind`` items; a ConfigError says what to change."""
    specs: list[FaultSpec] = []
    for item in items:
        parts = item.strip().split(":")
        hint = f"resiliency.faults item {item!r} must look like rank:step:kind, e.g. 1:5:exception"
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
        spec = FaultSpec(rank, step, kind)
        if any((s.rank, s.step) == (rank, step) for s in specs):
            raise ConfigError(f"resiliency.faults has two faults for rank {rank} at step {step}; keep one")
        specs.append(spec)
    return specs


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Human-readable flavour name, recorded in metrics and checkpoints."""
    dim: int = 256
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Number of query heads; must divide ``dim``."""
    n_kv_heads: int = 4
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int = 704
    """Hidden width of the SwiGLU feed-forward layer."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes it from the dataset manifest. Must be >= the dataset's vocabulary."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    def validate(self) -> None:
        _positive(self, "model", ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"))
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"model.dim / model.n_heads must be even for RoPE; got head dim {self.dim // self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be >= 0 (0 = from the dataset); got {self.vocab_size}")


@dataclass
class DataConfig:
    path: str = ""
    """Dataset directory holding ``manifest.json`` and token shards (see SHARDS.md). Required."""
    seq_len: int = 256
    """Tokens per training sample."""
    seed: int = 1234
    """Seed of the sample order; the same seed gives the same batches."""
    verify_checksums: bool = True
    """Verify every shard's sha256 before training (reads the whole dataset once)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("data.path is required: pass --data.path=<dataset dir with manifest.json>")
        _positive(self, "data", ("seq_len",))


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at ``lr * min_lr_ratio``."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    implementation: str = "auto"
    """AdamW kernel: ``auto`` (``fused`` on GPU, ``for_loop`` on CPU), ``fused`` (one multi-tensor CUDA kernel),
    ``foreach`` or ``for_loop`` (one parameter at a time: bit-identical between runs and world sizes on CPU)."""

    def validate(self) -> None:
        _positive(self, "optim", ("lr", "eps"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name} must be in [0, 1); got {getattr(self, name)}")
        _choice(self, "optim", "implementation", ("auto", "fused", "foreach", "for_loop"))


@dataclass
class TrainConfig:
    steps: int = 100
    """Total optimizer steps of the run (a resumed run continues up to this step)."""
    batch_size: int = 8
    """Micro-batch size per rank (sequences). Global batch = batch_size x world size."""
    seed: int = 0
    """Seed of weight initialisation (identical on every rank)."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 params / fp32 reductions on GPU, fp32 on CPU), ``bf16`` or ``fp32``."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass to save memory."""
    compile: bool = False
    """``torch.compile`` each transformer block (and, with ``compile_loss``, the final norm and the loss)."""
    compile_loss: bool = True
    """With ``compile``: also compile the final RMSNorm and the cross-entropy (the fp32 upcast is fused into the
    softmax, so no fp32 copy of the ``[tokens, vocab]`` logits is made); off leaves both eager."""
    reshard_after_forward: str = "auto"
    """FSDP2: free each block's gathered parameters after its forward and gather them again for the backward.
    ``auto``: only with more than one rank (with one there is nothing to save); ``always``; ``never``."""
    run_dir: str = "runs/default"
    """Directory for metrics (``metrics.jsonl``), the recovery ledger and, by default, checkpoints."""
    log_every: int = 1
    """Write a metrics line every N steps (the last step is always written)."""
    cpu_threads: int = 0
    """Intra-op threads per process on CPU; 0 = cores / local ranks."""
    deterministic: bool = True
    """Use deterministic algorithms (bit-identical reruns on CPU)."""
    gc_every: int = 50
    """Python's automatic garbage collection is off during the step loop (a collection can stall any step);
    a young-generation collection runs every N steps instead. 0 keeps automatic collection."""

    def validate(self) -> None:
        _positive(self, "train", ("steps", "batch_size", "log_every"))
        _choice(self, "train", "device", ("auto", "cpu", "cuda"))
        _choice(self, "train", "mixed_precision", ("auto", "bf16", "fp32"))
        _choice(self, "train", "reshard_after_forward", ("auto", "always", "never"))
        if self.cpu_threads < 0:
            raise ConfigError(f"train.cpu_threads must be >= 0 (0 = automatic); got {self.cpu_threads}")
        if self.gc_every < 0:
            raise ConfigError(f"train.gc_every must be >= 0 (0 = automatic collection); got {self.gc_every}")


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Checkpoint directory on shared storage; empty = ``<train.run_dir>/checkpoints``."""
    interval: int | str = 0
    """Memory checkpoint every N steps (a snapshot in host memory: it blocks only for the device-to-host copy);
    ``"auto"`` chooses N by Young/Daly, sqrt(2 * measured snapshot cost * ``mtbf_s``), logged and recorded in
    the recovery ledger; 0 checkpoints only at the end of the run."""
    persist_every: int = 1
    """Every N-th memory checkpoint is also written to ``dir`` in the background (the persistent tier, read by
    evaluation, the cluster layer and new nodes); 1 persists every one, 0 only the final one."""
    memory_slots: int = 2
    """Snapshot slots per rank in host memory (each holds this rank's whole state). The newest complete snapshot
    is never overwritten and a slot being persisted is locked, so with 2 a memory checkpoint is skipped while an
    older slot is still being written; 3 never skips."""
    node_local: bool = True
    """Publish each snapshot on the node (a header with a checksum beside the slot file) so a worker respawned
    on the same node resumes from it instead of the disk."""
    node_local_dir: str = "/dev/shm"
    """Memory-backed directory for the snapshot slots (a memory ``emptyDir`` in Kubernetes); ``entrypoint.sh``
    gives each job its own subdirectory and removes it when the job ends."""
    mtbf_s: float = 86400.0
    """Mean time between failures of the whole job, for ``interval = "auto"``."""
    keep: int = 2
    """Committed checkpoints to keep (>= 2 so a corrupt newest one can fall back)."""
    async_save: bool = True
    """Write in the background; training blocks only while the state is staged in host memory."""
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
        if self.persist_every < 0:
            raise ConfigError(f"checkpoint.persist_every must be >= 0 (0 = only the final save); got {self.persist_every}")
        if self.memory_slots < 2:
            raise ConfigError(
                f"checkpoint.memory_slots must be >= 2 so the newest snapshot stays valid while the next is staged; "
                f"got {self.memory_slots}"
            )
        if self.mtbf_s <= 0:
            raise ConfigError(f"checkpoint.mtbf_s must be > 0; got {self.mtbf_s}")
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
    faults: list[str] = field(default_factory=list)
    """Fault injection, ``rank:step:kind`` items (kinds: exception, hang, hang_gil, sigkill, oom, sigterm,
    corrupt_checkpoint). Off when empty; each fires once per run directory."""

    def validate(self) -> None:
        _choice(self, "resiliency", "heartbeats", ("auto", "on", "off"))
        _positive(self, "resiliency", (
            "soft_timeout_s", "hard_timeout_s", "heartbeat_timeout_s", "termination_grace_s",
            "monitor_process_interval_s", "progress_watchdog_interval_s", "collective_timeout_s",
            "preemption_grace_s",
        ))
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


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resiliency: ResiliencyConfig = field(default_factory=ResiliencyConfig)

    def validate(self) -> "JobConfig":
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        if self.train.device != "auto":  # "auto" is checked once the device is known (train.Resources)
            self.resiliency.check_collective_timeout("nccl" if self.train.device == "cuda" else "gloo")
        return self

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.train.run_dir) / "checkpoints")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "JobConfig":
        cfg = cls()
        for section_name, values in data.items():
            section = _section(cfg, section_name, source)
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
            for key, value in values.items():
                _set(section, section_name, key, value, source)
        return cfg


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)  # type: ignore[union-attr]
    return docs


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Defaults, then the TOML file, then ``section.key=value`` overrides; validated."""
    cfg = JobConfig()
    if path is not None:
        path = resolve_config_path(path)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        cfg = JobConfig.from_dict(data, source=str(path))
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        section_name, dot, name = key.partition(".")
        if not sep or not dot:
            raise ConfigError(f"override {item!r} must look like --section.key=value (e.g. --train.steps=200)")
        section = _section(cfg, section_name, "command line")
        _set(section, section_name, name, _parse_cli_value(section, section_name, name, value), "command line")
    return cfg.validate()


def resolve_config_path(path: str | Path) -> Path:
    """A path, or a flavour name (``tiny``, ``1b``, ``8b``) of the TOMLs shipped in ``trainer/configs``."""
    p = Path(path)
    if p.is_file():
        return p
    shipped = CONFIG_DIR / f"{path}.toml"
    if shipped.is_file():
        return shipped
    names = sorted(f.stem for f in CONFIG_DIR.glob("*.toml"))
    raise ConfigError(f"config {str(path)!r} is neither a file nor a shipped flavour; flavours: {names}")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, JobConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="FSDP2 trainer. Overrides: --section.key=value (e.g. --train.steps=200).",
    )
    parser.add_argument("--config", required=False, help="TOML file or flavour name (tiny, 1b, 8b)")
    parser.add_argument("--help-config", action="store_true", help="print every config key with its doc")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args, rest = parser.parse_known_args(argv)
    if args.help_config:
        return args, JobConfig()
    # Overrides: "--section.key=value" or "--section.key value".
    overrides: list[str] = []
    it = iter(rest)
    for arg in it:
        if not (arg.startswith("--") and "." in arg.split("=", 1)[0]):
            parser.error(f"unrecognised argument {arg!r}; overrides look like --section.key=value")
        overrides.append(arg if "=" in arg else f"{arg}={next(it, '')}")
    return args, load_config(args.config, overrides)


def describe() -> str:
    """All config keys with type, default and doc, for ``--help-config``."""
    lines = []
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory  # type: ignore[misc]
        docs = field_docs(cls)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"  {f.name} = {default!r}  ({_type_name(f.type)})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
def _section(cfg: JobConfig, name: str, source: str) -> Any:
    names = [f.name for f in dataclasses.fields(cfg)]
    if name not in names:
        raise ConfigError(f"{source}: unknown config section {name!r}; sections are {names}")
    return getattr(cfg, name)


def _field(section: Any, section_name: str, key: str, source: str) -> dataclasses.Field:
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"{source}: unknown key {section_name}.{key}; keys of [{section_name}]: {sorted(fields)}")
    return fields[key]


def _type_name(tp: Any) -> str:
    return tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))


def _set(section: Any, section_name: str, key: str, value: Any, source: str) -> None:
    f = _field(section, section_name, key, source)
    hints = typing.get_type_hints(type(section))
    expected = hints[key]
    origin = typing.get_origin(expected)
    ok: bool
    if origin is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigError(
            f"{source}: {section_name}.{key} must be of type {_type_name(f.type)}; got {value!r}"
        )
    setattr(section, key, value)


def _parse_cli_value(section: Any, section_name: str, key: str, raw: str) -> Any:
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        return raw  # _set reports the unknown key with the list of valid ones
    expected = hints[key]
    try:
        if expected is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if expected is int:
            return int(raw)
        if expected is float:
            return float(raw)
        if typing.get_origin(expected) is list:
            return [item for item in raw.split(",") if item] if raw else []
    except ValueError:
        raise ConfigError(
            f"command line: --{section_name}.{key}={raw!r} is not a valid {_type_name(expected)}"
        ) from None
    return raw


def _positive(section: Any, name: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = getattr(section, key)
        if value <= 0:
            raise ConfigError(f"{name}.{key} must be > 0; got {value}")


def _choice(section: Any, name: str, key: str, choices: tuple[str, ...]) -> None:
    value = getattr(section, key)
    if value not in choices:
        raise ConfigError(f"{name}.{key} must be one of {list(choices)}; got {value!r}")
