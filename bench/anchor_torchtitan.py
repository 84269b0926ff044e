"""torchtitan on exactly the trainer's model shape and settings: the anchor our throughput is compared with.

    python bench/anchor_torchtitan.py --config 1b [--nproc N] [--steps 40] [--skip 10] [--compile|--no-compile]
        [--attn flex|varlen] [--cuda-graphs|--no-cuda-graphs] [--out DIR] [--section.key=value ...]

Reads the trainer's own config (``--config`` flavour or TOML plus ``--section.key=value`` overrides) and builds
torchtitan's (pinned: 0.3.0) ``Trainer`` from it: a Llama-3 flavour with the trainer's dimensions is registered in
``torchtitan.models.llama3.llama3_configs`` at run time (no torchtitan code is copied here); sequence length,
micro-batch, activation checkpointing (full, per block), AdamW hyper-parameters and weight-decay groups, warm-up,
gradient clipping, bf16 parameters with fp32 reductions and fp32 master weights are the trainer's. Everything
else is torchtitan's default for its llama3 configs: fused AdamW, chunked cross-entropy (no full logits),
FlexAttention (the trainer uses SDPA's flash kernel), CUDA graphs around forward+backward, GC every 50 steps.
Tokens are synthetic (uniform over the vocabulary, one document per sample): speed does not depend on them.

With ``--nproc N`` the script starts itself under ``torchrun --standalone``. Rank 0 prints one JSON line: median
tokens/s over the 10-step windows after ``--skip`` (each window ends with a device sync, as the trainer's log
steps do), peak memory (reserved and allocated, GiB), versions, and the settings used.
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

    return load_config(config, ["--data.path=synthetic", *overrides])


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
    base = int(2 * 4 * m.dim / 3)  # torchtitan's SwiGLU width before ffn_dim_multiplier and multiple_of
    model_args = TransformerModelArgs(
        dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
        multiple_of=m.ffn_dim, ffn_dim_multiplier=m.ffn_dim / base, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),  # factor 1: no Llama-3.1 frequency scaling
    )
    name, flavour = "resilient_train", m.name
    register_train_spec(name, dataclasses.replace(
        llama3.get_train_spec(), model_args={flavour: model_args}, build_tokenizer_fn=None,
        build_dataloader_fn=dataloader, build_validator_fn=None,
    ))
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
    from torchtitan.tools.logging import init_logger

    if titan_version() >= (0, 3):
        from torchtitan.trainer import Trainer
    else:
        from torchtitan.train import Trainer

    marks: list[tuple[int, float]] = []

    class TimedTrainer(Trainer):
        """torchtitan's Trainer, plus a host clock read after a device sync every ``WINDOW`` steps (the steps
        on which torchtitan's own metrics already sync for the loss)."""

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
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
    device = torch.device("cuda", torch.cuda.current_device())
    result = {
        "figure": "anchor", "framework": "torchtitan", "version": torchtitan.__version__,
        "torch": torch.__version__, "label": args.label or f"torchtitan-{cfg.model.name}",
        "model": cfg.model.name, "gpus": world, "seq_len": cfg.data.seq_len, "batch_size": cfg.train.batch_size,
        "compile": compile_on, "activation_checkpointing": cfg.train.activation_checkpointing,
        "attn": args.attn if titan_version() >= (0, 3) else "sdpa",
        "cuda_graphs": args.cuda_graphs if titan_version() >= (0, 3) else False,
        "tokens_per_s": round(tps) if tps else None, "tokens_per_s_per_gpu": round(tps / world) if tps else None,
        "windows": {s: round(v) for s, v in windows},
        "mem_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
        "mem_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
    }
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def main() -> int:
    args, overrides = parse()
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
