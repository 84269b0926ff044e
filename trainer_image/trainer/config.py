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
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from trainer.config_checks import ConfigError, choice as _choice, positive as _positive, step_window
from trainer.config_recovery import KINDS, CheckpointConfig, FaultSpec, ResiliencyConfig, parse_faults

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

__all__ = [
    "CONFIG_DIR", "KINDS", "CheckpointConfig", "ConfigError", "DataConfig", "FaultSpec", "JobConfig", "ModelConfig",
    "OptimConfig", "ResiliencyConfig", "TrainConfig", "describe", "field_docs", "load_config", "parse_args",
    "parse_faults", "resolve_config_path",
]


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
    tie_embeddings: bool = False
    """Tie the output projection to the input embedding (Llama 3.2 1B/3B): one weight, ``tok_embeddings.weight``,
    used by both; checkpoints hold it under that one name (CHECKPOINTS.md)."""
    rope_scaling_factor: float = 0.0
    """Llama 3.1 RoPE frequency scaling (``rope_scaling.factor`` of a Hugging Face config, e.g. 8.0 or 32.0):
    low frequencies are divided by it, high ones kept, the band between interpolated; 0 = no scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 RoPE scaling: wavelengths above ``rope_original_max_len / rope_low_freq_factor`` are scaled."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 RoPE scaling: wavelengths below ``rope_original_max_len / rope_high_freq_factor`` are kept."""
    rope_original_max_len: int = 8192
    """Llama 3.1 RoPE scaling: the context length the model was pretrained with before scaling."""
    max_position_embeddings: int = 0
    """Context length written into an exported ``config.json`` (``python -m trainer.export``); 0 = ``data.seq_len``.
    Taken from the base model with ``from_hf``."""
    from_hf: str = ""
    """Start from a Llama-family Hugging Face checkpoint: a directory (``config.json`` + ``model.safetensors``, or
    shards with ``model.safetensors.index.json``) or a URI (``hf://<org>/<model>[@revision]``, ``s3://...``,
    ``gs://...``, ``file://...``; credentials from HF_TOKEN / AWS_* in the environment), which local rank 0 of
    each node downloads into ``from_hf_cache`` first. The shape (and ``name``) then come from its
    ``config.json``, overriding the keys above; its weights are read, each rank only its own FSDP shards, only
    when training starts fresh (a resumed run never reads them). Needs ``checkpoint.init_from`` empty."""
    from_hf_cache: str = ""
    """Node-local directory for a downloaded ``from_hf`` URI (reused by a restart on the same node once complete);
    empty = ``$TMPDIR/resilient-train-hf`` (the job's own TMPDIR under ``entrypoint.sh``)."""

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
        if self.max_position_embeddings < 0:
            raise ConfigError(
                f"model.max_position_embeddings must be >= 0 (0 = data.seq_len); got {self.max_position_embeddings}")
        if self.rope_scaling_factor < 0:
            raise ConfigError(f"model.rope_scaling_factor must be >= 0 (0 = no scaling); got {self.rope_scaling_factor}")
        if self.rope_scaling_factor > 0:
            _positive(self, "model", ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"))
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise ConfigError(
                    f"model.rope_high_freq_factor ({self.rope_high_freq_factor:g}) must be greater than "
                    f"model.rope_low_freq_factor ({self.rope_low_freq_factor:g}); Llama 3.1 uses 4.0 and 1.0")


@dataclass
class DataConfig:
    path: str = ""
    """Dataset directory holding ``manifest.json`` and token shards (see SHARDS.md). Required."""
    seq_len: int = 256
    """Tokens per training sample."""
    seed: int = 1234
    """Seed of the sample order; the same seed gives the same batches."""
    verify_checksums: bool = True
    """Verify every shard's sha256 before training (reads the whole dataset once per job: later starts skip the
    files verified before and unchanged since, recorded in ``<train.run_dir>/data-verified.json``)."""
    sample_log: bool = False
    """Each rank appends the samples it trained in each step to ``<train.run_dir>/samples/rank-<r>.jsonl``
    (``{"step", "epoch", "samples"}``: indices into the epoch's order): an audit of which samples each step consumed,
    across restarts and world sizes (SHARDS.md)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("data.path is required: pass --data.path=<dataset dir with manifest.json>")
        _positive(self, "data", ("seq_len",))


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate (AdamW); 0 leaves the weights exactly as loaded (a check of the load/export path)."""
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
    """AdamW kernel: ``auto`` (on GPU ``triton`` with one rank and Triton importable, else ``fused``; ``for_loop``
    on CPU), ``fused`` (one multi-tensor CUDA kernel), ``foreach`` or ``for_loop`` (one parameter at a time:
    bit-identical between runs and world sizes on CPU); ``triton`` (CUDA): a Triton kernel per parameter that, with
    one rank, reads the bf16 gradients and clipping's coefficient itself, so no fp32 gradient is ever made
    (``trainer/kernels.py``; faster a step than ``fused`` for a compiled ``1b`` on one H200: the ``fused-adamw`` row of
    ``bench/throughput_suite.sh loo``)."""

    def validate(self) -> None:
        _positive(self, "optim", ("eps",))
        if self.lr < 0:
            raise ConfigError(f"optim.lr must be >= 0; got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name} must be in [0, 1); got {getattr(self, name)}")
        _choice(self, "optim", "implementation", ("auto", "fused", "foreach", "for_loop", "triton"))


def accumulation(cfg: "TrainConfig", world_size: int) -> int:
    """Micro-batches each rank accumulates per optimizer step (``train.global_batch``); ConfigError when the world
    size does not divide the global batch into whole micro-batches, or when one rank would accumulate under
    ``single_rank=direct`` (``OneRank`` finishes, and clips, the gradients at the end of every backward)."""
    if not cfg.global_batch:
        return 1
    per_pass = cfg.batch_size * world_size
    if cfg.global_batch % per_pass:
        raise ConfigError(f"train.global_batch={cfg.global_batch} is not a multiple of train.batch_size x world size "
                          f"= {cfg.batch_size} x {world_size}: set a global batch every world size of the job divides "
                          f"(or another batch_size)")
    if world_size == 1 and cfg.single_rank == "direct" and cfg.global_batch > per_pass:
        raise ConfigError("train.single_rank=direct cannot accumulate gradients (it finishes them at every "
                          "backward's end): set train.single_rank=auto or a train.global_batch of batch_size")
    return cfg.global_batch // per_pass


def keep_global_batch(cfg: "TrainConfig", node_range: str, ranks_per_node: int) -> str | None:
    """The global batch every size of the job's node range ``MIN:MAX`` keeps (``TRAINER_NODE_RANGE``, from
    entrypoint.sh: a job that goes on with fewer nodes when one is lost). An unset ``train.global_batch`` becomes the
    full size's (batch_size x ranks per node x MAX); a size of the range that cannot split it into whole micro-batches
    is a ConfigError naming a global batch every size can and the fewest nodes that keep this one. Returns the line to
    log when it set the global batch; None for a range of one size."""
    low, _, high = node_range.partition(":")
    try:
        low_n, high_n = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"TRAINER_NODE_RANGE must be MIN:MAX nodes (entrypoint.sh sets it); got {node_range!r}")
    if not 1 <= low_n <= high_n:
        raise ConfigError(f"TRAINER_NODE_RANGE must be MIN:MAX nodes with 1 <= MIN <= MAX; got {node_range!r}")
    if low_n == high_n:
        return None
    note = None
    per_node = cfg.batch_size * ranks_per_node
    if not cfg.global_batch:
        cfg.global_batch = per_node * high_n
        note = (f"train.global_batch={cfg.global_batch} (the batch of {high_n} nodes), kept on any of {low_n} to "
                f"{high_n} nodes")
    sizes = range(low_n, high_n + 1)
    lost = [k for k in sizes if cfg.global_batch % (per_node * k)]
    if lost:
        unit = per_node * math.lcm(*sizes)
        fewest = lost[-1] + 1 if lost[-1] < high_n else None  # every size above the largest lost one keeps it
        keeps = f", or at least {fewest} as the fewest nodes (min_nodes)" if fewest else ""
        raise ConfigError(
            f"train.global_batch={cfg.global_batch} cannot be kept on {lost[0]} node(s) of the job's range "
            f"{low_n}:{high_n} ({ranks_per_node} rank(s) a node x train.batch_size={cfg.batch_size}): set a global "
            f"batch every size divides, a multiple of {unit} (e.g. {-(-cfg.global_batch // unit) * unit}){keeps}")
    for k in sizes:
        accumulation(cfg, k * ranks_per_node)  # a size whose accumulation this config refuses (single_rank=direct)
    return note


@dataclass
class TrainConfig:
    steps: int = 100
    """Total optimizer steps of the run (a resumed run continues up to this step)."""
    batch_size: int = 8
    """Micro-batch size per rank (sequences). Global batch = batch_size x world size, unless ``global_batch``."""
    global_batch: int = 0
    """Sequences per optimizer step across all ranks; 0: ``batch_size`` x world size (one micro-batch per rank).
    Else a multiple of ``batch_size`` x world size: each rank accumulates the gradients of
    ``global_batch / (batch_size x world size)`` micro-batches per step, so the global batch, the samples of each
    step and the schedule stay the same on any world size that divides it (a resume on fewer or more ranks)."""
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
    """Free each transformer block's compute-dtype parameters after its forward (not the last block's: its backward
    comes right away) and make them again for its backward: less memory at the step's peak for more work.
    ``auto``, ``always`` or ``never``. FSDP2 all-gathers them again; ``auto`` means only with more than one rank
    (on one, that gather is a copy that costs time). One rank without FSDP2 (``single_rank=direct``) casts the fp32
    parameters to bf16 again (the same values; nothing to do with fp32 compute): ``auto`` and ``always`` reshard
    (``1b``: 15 blocks x 60.8M parameters x 2 bytes = 1.70 GiB freed at the step's peak, ``trainer/onerank.py``),
    ``never`` keeps the copies from the forward to the end of the backward."""
    single_rank: str = "auto"
    """With one rank: ``direct`` keeps the parameters as the one-rank DTensors FSDP2 would make (the same checkpoint
    layout and optimizer) but runs no FSDP2: each forward copies them once to the compute dtype, and when the
    backward ends the gradients become fp32 in one pass, clipped on the way (``trainer/onerank.py``): the values of
    FSDP2 on one rank, without its all-gather and reduce-scatter copies. ``fsdp``: FSDP2 as with more ranks.
    ``auto``: ``direct`` unless ``activation_checkpointing`` is on (its recomputation in the backward needs FSDP2's
    parameter handling). Ignored with more than one rank."""
    chunked_loss: bool = True
    """Cross-entropy in row chunks that writes its gradient over the logits (``trainer/loss.py``): no second
    ``[tokens, vocab]`` buffer for the gradient and, in eager mode, no fp32 copy of the logits. Same fp32 math."""
    rope_kernel: str = "auto"
    """How RoPE rotates channel pairs, in fp32 either way: ``complex`` (one complex multiplication: one kernel in
    eager mode; ``torch.compile`` runs it outside its graphs), ``real`` (four real products that Inductor fuses with
    the projections), ``auto``: ``real`` compiled, ``complex`` in eager mode. Compiled, ``real`` is as fast as
    ``complex`` or slightly faster a step on one H200 (the ``real-rope`` row of ``bench/throughput_suite.sh loo``), at
    the same peak allocated memory; its peak *reserved* memory varies with the default allocator's fragmentation,
    which ``entrypoint.sh``'s expandable segments remove."""
    kernels: str = "auto"
    """Hand-written Triton kernels (``trainer/kernels.py``) for what PyTorch runs as several passes or through a slow
    path: the chunked loss's two kernels (compiled too: faster a step than Inductor's on one H200), SwiGLU (eager
    mode only: compiled, Inductor fuses the same ops) and one rank's gradients to fp32. ``auto``: on CUDA, if
    Triton imports; ``triton``: the same, and an error if Triton is missing; ``torch``: PyTorch's own ops. Never on
    CPU (CPU runs stay bit-identical to their history). Same fp32 arithmetic, one rounding per kernel."""
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
    profile_steps: str = ""
    """``FIRST-LAST`` (e.g. ``30-32``): a ``torch.profiler`` trace of those steps on every rank, host and device, in
    ``<run_dir>/profile/`` (``trainer/profiling.py``); writing it stalls the step after the window (seconds). Empty:
    no profiling."""

    def validate(self) -> None:
        _positive(self, "train", ("steps", "batch_size", "log_every"))
        if self.global_batch < 0 or (self.global_batch and self.global_batch % self.batch_size):
            raise ConfigError(f"train.global_batch={self.global_batch} is not a multiple of train.batch_size="
                              f"{self.batch_size}: set it to a multiple of the batch size (0: batch size x world size)")
        _choice(self, "train", "device", ("auto", "cpu", "cuda"))
        _choice(self, "train", "mixed_precision", ("auto", "bf16", "fp32"))
        _choice(self, "train", "reshard_after_forward", ("auto", "always", "never"))
        _choice(self, "train", "single_rank", ("auto", "direct", "fsdp"))
        _choice(self, "train", "rope_kernel", ("auto", "complex", "real"))
        _choice(self, "train", "kernels", ("auto", "triton", "torch"))
        if self.single_rank == "direct" and self.activation_checkpointing:
            raise ConfigError("train.single_rank=direct cannot recompute activations: set train.single_rank=auto "
                              "(FSDP2 with activation checkpointing) or train.activation_checkpointing=false")
        if self.cpu_threads < 0:
            raise ConfigError(f"train.cpu_threads must be >= 0 (0 = automatic); got {self.cpu_threads}")
        if self.gc_every < 0:
            raise ConfigError(f"train.gc_every must be >= 0 (0 = automatic collection); got {self.gc_every}")
        step_window("train.profile_steps", self.profile_steps)


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
        if self.model.from_hf and self.checkpoint.init_from:
            raise ConfigError(
                "model.from_hf and checkpoint.init_from both say where the first weights come from; keep one "
                f"(model.from_hf={self.model.from_hf!r}, checkpoint.init_from={self.checkpoint.init_from!r})")
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
