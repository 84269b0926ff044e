"""torchtitan on exactly the trainer's model shape and settings: the anchor our throughput is compared with.

    python bench/anchor_torchtitan.py --config 1b [--nproc N] [--steps 40] [--skip 10] [--compile|--no-compile]
        [--check] [--out DIR] [--label NAME] [--section.key=value ...]

Reads the trainer's own config (``--config`` flavour or TOML plus ``--section.key=value`` overrides) and builds
torchtitan's ``Trainer`` from it, through torchtitan's own API (no torchtitan code is copied here):

- **torchtitan 0.2** (0.2.2 runs on PyTorch 2.11, the GPU machine's): a ``TrainSpec`` registered at run time with a
  Llama-3 flavour of the trainer's dimensions, written the way torchtitan writes its flavours (the 1b: dim 2048,
  16 layers, 32/8 heads, ``ffn_dim_multiplier`` 1.5, ``multiple_of`` 256, ``rope_theta`` 500,000, vocabulary
  128,256; RoPE without Llama-3.1 frequency scaling, as the trainer). Sequence length, micro-batch, activation
  checkpointing, AdamW hyper-parameters (fused, as torchtitan's default), warm-up and clipping are the trainer's;
  torchtitan 0.2 decays every parameter (no weight-decay groups). On one GPU torchtitan applies no FSDP: fp32
  parameters under ``torch.autocast(bf16)``; compile per block and the loss (``compile.components``).
- **torchtitan 0.3** (needs a newer PyTorch): ``Trainer.Config`` with its defaults for llama3 (FlexAttention,
  chunked cross-entropy, CUDA graphs) and the trainer's weight-decay groups.

Tokens are synthetic (uniform over the vocabulary, one document per sample): speed does not depend on them.

Timing, as the trainer's runner (``bench/trainer_run.py``) does: a CUDA event at the start of every step
(``figures.StepClock``, no extra host sync) gives every step's time; the JSON line's ``tokens_per_s_steps`` is the
median over the steps after ``--skip``. torchtitan logs (and syncs) every 10 steps, as the trainer's ``1b`` does;
``tokens_per_s`` is the median of those 10-step windows. Peak memory: ``max_memory_reserved`` / ``_allocated``
read after every step (torchtitan resets the peaks when it logs).

``--check`` builds everything but the ``Trainer`` (config, flavour, model on the meta device, a batch) and
compares the parameter count with the trainer's: it runs on a CPU (torchtitan 0.2).

With ``--nproc N`` the script starts itself under ``torchrun --standalone``. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

WINDOW = 10  # steps per timing window: the trainer's log_every in the 1b/8b flavours


ANCHOR_ARGS = "ANCHOR_ARGS"  # set in the workers started by torchrun


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="1b", help="the trainer's flavour or TOML")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes) on this host")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the median")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile per block and the loss; default: the trainer config's train.compile")
    parser.add_argument("--attn", default="flex", choices=("flex", "varlen"), help="torchtitan attention backend")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--check", action="store_true", help="no training: build config, model (meta) and a batch")
    parser.add_argument("--out", default="runs/anchor", help="torchtitan's dump folder")
    parser.add_argument("--label", default="")
    argv = json.loads(os.environ[ANCHOR_ARGS]) if ANCHOR_ARGS in os.environ else sys.argv[1:]
    return parser.parse_known_args(argv)


def relaunch(args: argparse.Namespace) -> int:
    """Start this script under torchrun, one process per GPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__]
    # The arguments travel in the environment: torchrun would take `--nproc` etc. for abbreviations of its own.
    return subprocess.call(cmd, env={**os.environ, ANCHOR_ARGS: json.dumps(sys.argv[1:])})


def trainer_config(config: str, overrides: list[str]) -> Any:
    from trainer.config import load_config

    cfg = load_config(config, ["--data.path=synthetic", *overrides])
    if cfg.model.vocab_size == 0:  # the trainer takes it from its dataset; the anchor has none
        raise SystemExit(f"{config}: model.vocab_size is 0 (from the dataset); pass --model.vocab_size=N")
    return cfg


def titan_version() -> tuple[int, int]:
    import torchtitan

    major, minor = torchtitan.__version__.split(".")[:2]
    return int(major), int(minor)


class SyntheticBatches:
    """Uniform random tokens, one document per sample (causal attention over the whole sample, as ours)."""

    def setup(self, vocab_size: int, seed: int, rank: int, seq_len: int, batch: int, positions: bool) -> None:
        import torch

        self.shape = (batch, seq_len + 1)
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed + rank)
        # torchtitan 0.3 builds its attention masks from per-document positions: 0..seq-1, one document.
        self.positions = torch.arange(seq_len).expand(batch, seq_len).contiguous() if positions else None

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        import torch

        while True:
            tokens = torch.randint(0, self.vocab_size, self.shape, generator=self.generator)
            batch = {"input": tokens[:, :-1].contiguous()}
            if self.positions is not None:
                batch["positions"] = self.positions
            yield batch, tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# --- torchtitan 0.3: Trainer.Config, flavours as config factories, Configurable data and tokenizer ----------
def build_v03(args: argparse.Namespace, cfg: Any) -> tuple[Any, bool]:
    """(Trainer.Config, compile on) for torchtitan 0.3."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models import llama3
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    tokenizer_cls, data_cls = _v03_data_classes()
    flavour = f"resilient-train-{cfg.model.name}"
    llama3.llama3_configs[flavour] = _v03_flavour(cfg.model)
    spec = llama3.model_registry(flavour, attn_backend=args.attn)
    o = cfg.optim
    adamw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    compile_on = cfg.train.compile if args.compile is None else args.compile
    config = Trainer.Config(
        model_spec=spec,
        dump_folder=args.out,
        tokenizer=tokenizer_cls.Config(vocab_size=cfg.model.vocab_size),
        dataloader=data_cls.Config(vocab_size=cfg.model.vocab_size, seed=cfg.data.seed),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        # The trainer's weight-decay policy: none on norms and the embedding (torchtitan's default decays all).
        optimizer=OptimizersContainer.Config(param_groups=[
            ParamGroupConfig(pattern=r".*(norm|tok_embeddings).*", optimizer_name="AdamW",
                             optimizer_kwargs={**adamw, "weight_decay": 0.0}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                             optimizer_kwargs={**adamw, "weight_decay": o.weight_decay}),
        ]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=o.warmup_steps, total_steps=cfg.train.steps,
                                                  decay_type="cosine", min_lr_factor=o.min_lr_ratio),
        training=TrainingConfig(local_batch_size=cfg.train.batch_size, seq_len=cfg.data.seq_len, steps=args.steps,
                                max_norm=o.grad_clip, mixed_precision_param="bfloat16",
                                mixed_precision_reduce="float32", disable_cuda_graphs=not args.cuda_graphs),
        metrics=MetricsProcessor.Config(log_freq=WINDOW),
        activation_checkpoint=FullAC.Config() if cfg.train.activation_checkpointing else None,
        compile=CompileConfig(enable=compile_on, components=["model", "loss"]),
    )
    return config, compile_on


def _v03_flavour(model: Any) -> Any:
    """The trainer's dimensions, built the way torchtitan 0.3 builds its own flavours (``_1b``, ``_8b``), with
    untied embedding and output (the trainer's) and no RoPE frequency scaling (the trainer has none)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    def flavour(attn_backend: str, tp_gemm_backend: str = "default") -> Any:
        return llama3.Llama3Model.Config(
            dim=model.dim,
            vocab_size=model.vocab_size,
            enable_weight_tying=False,
            tok_embeddings=Embedding.Config(num_embeddings=model.vocab_size, embedding_dim=model.dim,
                                            param_init=llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=model.dim, eps=model.norm_eps, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=model.dim, out_features=model.vocab_size,
                                  param_init=llama3._output_linear_init(model.dim)),
            layers=llama3._build_llama3_layers(
                n_layers=model.n_layers, dim=model.dim, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
                hidden_dim=model.ffn_dim,
                rope=ComplexRoPE.Config(dim=model.dim // model.n_heads, max_seq_len=131072,
                                        theta=model.rope_theta, scaling="none"),
                attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend,
            ),
        )

    return flavour


def _v03_data_classes() -> tuple[type, type]:
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        """The tokens are synthetic; torchtitan only asks the tokenizer for its vocabulary size."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("synthetic tokens: nothing to encode")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("synthetic tokens: nothing to decode")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticTokens(SyntheticBatches, BaseDataLoader):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0
            seed: int = 0

        def __init__(self, config: Any, *, dp_rank: int, seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
            self.setup(config.vocab_size, config.seed, dp_rank, seq_len, local_batch_size, positions=True)

    return NoTokenizer, SyntheticTokens


# --- torchtitan 0.2: JobConfig, TrainSpec registry, model args --------------------------------------------------
LLAMA3_FFN = ((1.5, 256), (1.3, 1024), (1.3, 4096))  # Llama 3.2 1B/3B, 3 8B, 3 70B: (ffn_dim_multiplier, multiple_of)
_REGISTERED: set[str] = set()


def llama3_ffn(dim: int, ffn_dim: int) -> tuple[float, int]:
    """(ffn_dim_multiplier, multiple_of) of a published Llama 3 flavour that gives ``ffn_dim`` through torchtitan's
    formula; else a pair that gives it exactly."""
    base = int(2 * 4 * dim / 3)  # torchtitan's SwiGLU width before ffn_dim_multiplier and multiple_of
    for multiplier, multiple_of in LLAMA3_FFN:
        hidden = int(multiplier * base)
        if multiple_of * ((hidden + multiple_of - 1) // multiple_of) == ffn_dim:
            return multiplier, multiple_of
    return ffn_dim / base, ffn_dim


def build_v02(args: argparse.Namespace, cfg: Any) -> tuple[Any, bool]:
    """(JobConfig, compile on) for torchtitan 0.2, with a TrainSpec registered for the trainer's flavour."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.config import JobConfig
    from torchtitan.models import llama3
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
    from torchtitan.protocols.train_spec import register_train_spec

    class SyntheticTokens(SyntheticBatches, BaseDataLoader):
        pass

    def dataloader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **kwargs: Any) -> Any:
        loader = SyntheticTokens()
        loader.setup(cfg.model.vocab_size, cfg.data.seed, dp_rank, job_config.training.seq_len,
                     job_config.training.local_batch_size, positions=False)
        return loader

    m = cfg.model
    multiplier, multiple_of = llama3_ffn(m.dim, m.ffn_dim)
    model_args = TransformerModelArgs(
        dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
        multiple_of=multiple_of, ffn_dim_multiplier=multiplier, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),  # factor 1: no Llama-3.1 frequency scaling
    )
    name, flavour = "resilient_train", m.name
    if name not in _REGISTERED:  # the registry refuses a second registration of the name
        register_train_spec(name, dataclasses.replace(
            llama3.get_train_spec(), model_args={flavour: model_args}, build_tokenizer_fn=None,
            build_dataloader_fn=dataloader, build_validator_fn=None, state_dict_adapter=None,
        ))
        _REGISTERED.add(name)
    o = cfg.optim
    compile_on = cfg.train.compile if args.compile is None else args.compile
    job = JobConfig()
    job.job.dump_folder = args.out
    job.model.name, job.model.flavor = name, flavour
    job.optimizer.lr, job.optimizer.beta1, job.optimizer.beta2 = o.lr, o.beta1, o.beta2
    job.optimizer.eps, job.optimizer.weight_decay, job.optimizer.implementation = o.eps, o.weight_decay, "fused"
    job.lr_scheduler.warmup_steps, job.lr_scheduler.total_steps = o.warmup_steps, cfg.train.steps
    job.lr_scheduler.decay_type, job.lr_scheduler.min_lr_factor = "cosine", o.min_lr_ratio
    t = job.training
    t.local_batch_size, t.seq_len, t.steps, t.max_norm = cfg.train.batch_size, cfg.data.seq_len, args.steps, o.grad_clip
    t.mixed_precision_param, t.mixed_precision_reduce = "bfloat16", "float32"
    job.metrics.log_freq = WINDOW
    job.activation_checkpoint.mode = "full" if cfg.train.activation_checkpointing else "none"
    job.compile.enable = compile_on
    job.compile.components = ["model", "loss"]
    job.checkpoint.enable = False
    job.validation.enable = False
    return job, compile_on


def run_worker(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    import torch
    import torchtitan
    from figures import StepClock, step_figure
    from torchtitan.tools.logging import init_logger

    if titan_version() >= (0, 3):
        from torchtitan.trainer import Trainer
    else:
        from torchtitan.train import Trainer

    clock = StepClock()
    marks: list[tuple[int, float]] = []
    peaks = {"mem_reserved_gib": 0.0, "mem_allocated_gib": 0.0}

    class TimedTrainer(Trainer):
        """torchtitan's Trainer, plus an event at the start of every step, the host clock after a device sync
        every ``WINDOW`` steps (the steps on which torchtitan's own metrics already sync for the loss), and the
        peak memory after every step."""

        def train_step(self, data_iterator: Any) -> None:
            clock.mark(self.step)
            super().train_step(data_iterator)
            if self.step == self.job_config.training.steps:
                clock.mark(self.step + 1)
            if not torch.cuda.is_available():
                return
            peaks["mem_reserved_gib"] = max(peaks["mem_reserved_gib"], torch.cuda.max_memory_reserved() / 2**30)
            peaks["mem_allocated_gib"] = max(peaks["mem_allocated_gib"], torch.cuda.max_memory_allocated() / 2**30)
            if self.step % WINDOW == 0:
                torch.cuda.synchronize()
                marks.append((self.step, time.perf_counter()))

    init_logger()
    cfg = trainer_config(args.config, overrides)
    config, compile_on = (build_v03 if titan_version() >= (0, 3) else build_v02)(args, cfg)
    trainer = TimedTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * world
    windows = [(s1, tokens_per_step * (s1 - s0) / (t1 - t0)) for (s0, t0), (s1, t1) in zip(marks, marks[1:])
               if s0 >= args.skip]
    tps = statistics.median(v for _, v in windows) if windows else None
    result = {
        "figure": "anchor", "framework": "torchtitan", "version": torchtitan.__version__,
        "torch": torch.__version__, "label": args.label or f"torchtitan-{cfg.model.name}",
        "model": cfg.model.name, "gpus": world, "seq_len": cfg.data.seq_len, "batch_size": cfg.train.batch_size,
        "compile": compile_on, "activation_checkpointing": cfg.train.activation_checkpointing,
        "attn": args.attn if titan_version() >= (0, 3) else "sdpa",
        "cuda_graphs": args.cuda_graphs if titan_version() >= (0, 3) else False,
        "tokens_per_s": round(tps) if tps else None, "tokens_per_s_per_gpu": round(tps / world) if tps else None,
        "windows": {s: round(v) for s, v in windows},
        **{k: round(v, 2) for k, v in peaks.items()},
        **step_figure(clock.seconds(), tokens_per_step, args.skip, args.steps),
    }
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def check_v02(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """Everything ``run_worker`` builds before torchtitan's ``Trainer`` (which needs a GPU): the job config, the
    registered flavour, the model on the meta device, the data; the parameter count against the trainer's."""
    import torch
    import torchtitan
    from torchtitan.protocols.train_spec import get_train_spec

    from trainer.model import count_params

    cfg = trainer_config(args.config, overrides)
    job, compile_on = build_v02(args, cfg)
    spec = get_train_spec(job.model.name)
    model_args = spec.model_args[job.model.flavor]
    model_args.update_from_config(job)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    params = sum(p.numel() for p in model.parameters())
    layer = model.layers["0"]
    loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=job)
    inputs, labels = next(iter(loader))
    return {
        "figure": "anchor-check", "version": torchtitan.__version__, "model": cfg.model.name,
        "params": params, "trainer_params": count_params(cfg.model)["total"],
        "ffn_dim": layer.feed_forward.w1.out_features, "trainer_ffn_dim": cfg.model.ffn_dim,
        "ffn_dim_multiplier": model_args.ffn_dim_multiplier, "multiple_of": model_args.multiple_of,
        "rope_theta": model_args.rope_theta, "vocab_size": model_args.vocab_size, "compile": compile_on,
        "batch": list(inputs["input"].shape), "labels": list(labels.shape),
        "optimizer": job.optimizer.implementation, "log_freq": job.metrics.log_freq,
    }


def main() -> int:
    args, overrides = parse()
    if args.check:
        result = check_v02(args, overrides)
        print(json.dumps(result), flush=True)
        return 0 if result["params"] == result["trainer_params"] else 1
    if ANCHOR_ARGS not in os.environ:
        return relaunch(args)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        result = run_worker(args, overrides)
    except Exception as exc:  # one JSON line either way: the suite's table shows the failure
        result = {"figure": "anchor", "framework": "torchtitan", "label": args.label, "error": f"{type(exc).__name__}: {exc}"}
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))
    sys.exit(main())
