"""The warm-up of a process's kernels for a run: what a new process otherwise makes or loads on its first step.

A new process pays on its first training step for what Triton, CUDA and PyTorch make or load lazily: the Triton
kernels of ``trainer/kernels.py`` (compiled at their first call, for the dtypes and integer classes they are called
with, into an on-disk cache, ``$TRITON_CACHE_DIR``, that a fresh container has empty), each kernel's module
(``CUDA_MODULE_LOADING=LAZY``), cuBLAS and cuBLASLt handles and their heuristics for each GEMM shape, flash
attention's kernels, autograd's device threads, the optimizer's kernel.

``plan`` works out what the run calls, with the worker's own choices (``parallel.triton_kernels``,
``parallel.one_rank_direct``, ``optimizer.adamw_implementation`` at the run's world size, the compute dtype, the
parameters' sizes from a model on the meta device). It is warmed in two stages:

1. **compile**, no device: ``compile_ahead`` compiles the planned Triton kernels and their host-side launchers into
   the on-disk cache (``kernels.compile_ahead``: no launch, no device memory), in the order a step first calls
   them. It makes no CUDA context (the compile target comes from NVML), so a GPU in exclusive-process mode is left
   to the worker. Nothing waits for it: a kernel the worker reaches first, the worker compiles itself (Triton's
   cache writes are atomic);
2. **load**, on the device: ``warm`` builds one block of the configured model (``warm_config``) on the meta device,
   fills it with ``init_weights``'s own generator in the compute dtype with the eager kernels of ``[train]``
   (``parallel.set_kernels``: the RoPE kernel, the Triton SwiGLU and loss), runs one forward and backward and the
   gradients' norms (``torch._foreach_norm``, as clipping does); then the optimizer's kernel (the Triton AdamW with
   or without clipping's coefficient, or the fused / foreach CUDA one), and OneRank's gradient upcast where it
   runs, on a few elements of each integer class the run's parameters fall in (Triton specialises an integer on
   being 1, a multiple of 16, or 64-bit; a 64-bit one is left to the run); then everything is freed and the
   allocator's cache emptied. It needs no process group, draws from no RNG stream of the run and touches no
   parameter, optimizer state or data position of it. It is skipped, with a reason, when the device has less than
   twice its estimated memory free (``too_little_memory``). Nothing is compiled by Inductor: a compiled run's
   kernels are specific to its shapes, and Inductor's cache on disk serves those.

Its callers choose only what differs:

- ``entrypoint.sh``, once per node before ``ft_launcher``, runs the compile stage in a process of its own
  (``python -m trainer.startup.warmup <the trainer's arguments>``, knob ``TRAINER_COMPILE_AHEAD``) and exports
  ``TRAINER_COMPILE_AHEAD=started`` so no worker starts another. Without the entrypoint (``torchrun -m trainer``)
  the worker of local rank 0 starts it (``spawn``) right after parsing its arguments, in its first attempt only (a
  restarted worker finds the cache filled). Never on a machine without an NVIDIA device, nor for
  ``train.device=cpu``. It logs one line (what it compiled, in how long and where the time went, or why not;
  nothing for arguments the worker itself rejects) and always exits 0. It stays a process of its own rather than a
  child of the node's fork server: it then compiles while the fork server imports and ``ft_launcher`` starts
  (a forked child exists only once the server's imports are done), the same way where no fork server runs
  (``TRAINER_FORKSERVER=0``, or ``torchrun`` without the entrypoint), and the patch of Triton's driver that sets
  its compile target (``_target_without_a_context``) ends with that process instead of reaching the workers.
- A warm standby (``trainer/startup/standby.py``, knob ``resiliency.standby_prewarm``) runs the load stage
  synchronously before it listens (``for_standby``), at small shapes (``SMALL_VOCAB``, ``SMALL_TOKENS``, a batch of
  one, eager): it warms once the worker it will replace has finished its first step, beside that worker, which
  fills the device. ``STANDBY_WARMED`` then tells the worker it becomes.
- A new GPU worker (``train.Resources.start_warmup``, knob ``resiliency.start_warmup``) runs the load stage at the
  run's shapes in a background thread (``for_new_worker``) beside the rest of its start (recovery layers,
  in-process Wrapper, process group, model build, restore), on its device; ``train()`` joins it before the first
  step (start phase ``warm``): what it did not finish by then the start pays, never the first step. Not for a
  compiled run (Inductor's kernels), on the CPU, or in a standby's worker (warmed already). An in-process restart
  never runs it (its process is warm). Its effect: BENCHMARKS.md, "First step of a new worker".

torch is imported by the functions that use it: ``trainer.cli`` imports this module before torch, to start the
compile stage at once.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from trainer.config import JobConfig

ENV = "TRAINER_COMPILE_AHEAD"
"""``0`` turns the compile stage off; ``started``: ``entrypoint.sh`` started the node's one."""
PROG = "trainer.startup.warmup"
BYTES_PER_PARAM = 8
"""A warm-up parameter: fp32, its compute-dtype copy and that copy's gradient (no optimizer state)."""
PREDECESSOR_WAIT_S = 30.0
"""How long a new worker's warm-up waits for its memory while a dead predecessor's is released; then it is skipped."""
SMALL_VOCAB = 4096
SMALL_TOKENS = 512
"""A standby's shapes (``warm_config(small=True)``): at most this vocabulary, one sequence of at most this many."""
STANDBY_WARMED = False
"""This process ran ``for_standby`` (a standby that became a worker): its kernels are loaded."""


# --- what the run calls -----------------------------------------------------------------------------------------

def uses_triton(cfg: JobConfig) -> bool:
    """Whether the run of ``cfg`` may call the Triton kernels at all (a GPU run whose kernels or AdamW may be them)."""
    if cfg.train.device == "cpu":
        return False
    return cfg.train.kernels != "torch" or cfg.optim.implementation in ("auto", "triton")


@dataclass(frozen=True)
class Plan:
    """What a step of the run calls that loads lazily (``plan``)."""

    triton: frozenset[str]
    """The Triton kernels the step runs (``parallel.triton_kernels``' names): OneRank's gradient pass
    (``grad_upcast``) only where it runs (one rank, an AdamW other than Triton's)."""
    adamw: str
    """``optim.implementation`` resolved for the run's world size."""
    one_rank: bool
    clip: bool
    dtype: torch.dtype
    vocab: int
    activation_numel: int
    """Tokens of a batch x the FFN width: SwiGLU's elements."""
    param_numels: tuple[int, ...]

    def compile_arguments(self) -> dict:
        """``kernels.compile_ahead``'s arguments. With one rank the Triton AdamW reads OneRank's compute-dtype
        gradients (with clipping's coefficient); with FSDP2 it is not auto's choice, and an explicit one reads fp32
        gradients, which the compile stage leaves to the load stage."""
        adamw = self.one_rank and self.adamw == "triton"
        return {"which": self.triton, "vocab": self.vocab, "dtype": self.dtype,
                "activation_numel": self.activation_numel, "param_numels": list(self.param_numels),
                "adamw_coef": self.clip if adamw else None}


def plan(cfg: JobConfig, world_size: int, device: torch.device | None = None) -> Plan:
    """What the worker of ``cfg`` at ``world_size`` ranks calls on ``device`` (by default a CUDA device, not
    touched): the worker's own choices, from its configuration only."""
    import torch

    from trainer import parallel
    from trainer.model import Transformer
    from trainer.optimizer import adamw_implementation

    device = device or torch.device("cuda")
    one_rank = parallel.one_rank_direct(cfg.train, world_size)
    adamw = adamw_implementation(cfg.optim, device, one_rank=one_rank)
    triton = set(parallel.triton_kernels(cfg.train, device))
    if not one_rank or adamw == "triton":
        triton.discard("grad_upcast")
    with torch.device("meta"):
        model = Transformer(cfg.model, max_seq_len=cfg.data.seq_len)
    return Plan(triton=frozenset(triton), adamw=adamw, one_rank=one_rank, clip=cfg.optim.grad_clip > 0,
                dtype=parallel.mixed_precision(cfg.train, device).param_dtype or torch.float32,
                vocab=cfg.model.vocab_size,
                activation_numel=cfg.train.batch_size * cfg.data.seq_len * cfg.model.ffn_dim,
                param_numels=tuple(p.numel() for p in model.parameters()))


def integer_classes(numels: list[int] | tuple[int, ...]) -> list[int]:
    """A few-element stand-in for each class of Triton's integer specialisation among ``numels`` (1, a multiple of
    16, neither); 64-bit sizes have none (left to the run)."""
    stand_in = {(True, False): 1, (False, True): 4096, (False, False): 4095}
    return sorted({stand_in[(n == 1, n % 16 == 0 and n != 1)] for n in numels if n < 2**31})


# --- stage 1: compile into Triton's on-disk cache, no device -----------------------------------------------------

def wanted(cfg: JobConfig) -> bool:
    """Whether this worker should start the compiling process: the run may use the Triton kernels, on a machine with
    an NVIDIA device, from local rank 0 only (one per node), in the first attempt only, unless the entrypoint
    started it already (``TRAINER_COMPILE_AHEAD=started``) or it is off (``TRAINER_COMPILE_AHEAD=0``)."""
    if os.environ.get(ENV, "1") in ("0", "started") or not uses_triton(cfg):
        return False
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return False
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.path.exists("/dev/nvidiactl")


def spawn(argv: list[str], cfg: JobConfig) -> subprocess.Popen | None:
    """Start ``python -m trainer.startup.warmup argv`` in the background when ``wanted``; its line goes to stderr.
    Same process group as the worker: a launcher that stops the worker's group stops it too."""
    if not wanted(cfg):
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", PROG, *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
    except OSError:
        return None  # an optimisation only: the worker compiles what it needs itself


def resolve_shape(cfg: JobConfig) -> None:
    """The model's shape as the worker will resolve it (``train.Resources``): from ``model.from_hf``'s config.json
    when that is a local directory (nothing is fetched from remote storage twice: ValueError otherwise), a
    vocabulary of 0 from the dataset's manifest."""
    if cfg.model.from_hf:
        if not os.path.isdir(cfg.model.from_hf):
            raise ValueError("model.from_hf is not a local directory")
        from trainer.hf import BaseModel

        BaseModel.for_model(cfg.model, 0)
    if cfg.model.vocab_size == 0:
        from trainer.data import ShardedTokens

        cfg.model.vocab_size = ShardedTokens(cfg.data.path, verify=False).vocab_size  # reads the manifest only


def _target_without_a_context() -> None:
    """Point Triton's compile target at this machine's GPU from NVML, so compiling makes no CUDA context."""
    import pynvml

    pynvml.nvmlInit()
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-"))
              else pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0))
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    active = driver.active
    target = GPUTarget("cuda", major * 10 + minor, 32)
    active.get_current_target = lambda: target
    active.get_current_device = lambda: 0
    active.get_current_stream = lambda device=None: 0  # asked for before a warm-up returns: no launch uses it


def _launcher(kernel) -> int:  # noqa: ANN001 - Triton's CompiledKernel
    """Build the kernel's host-side launcher too (Triton compiles one per signature, with the C compiler, at the
    kernel's first launch, and caches it on disk beside the kernels): no CUDA context needed. 1 if built."""
    from triton.runtime import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - this Triton's launcher is made differently: the worker makes it
        return 0
    return 1


def compile_ahead(argv: list[str]) -> int:
    """Stage 1 for the trainer's arguments ``argv``, at ``$WORLD_SIZE`` ranks: one line on stderr; always 0."""
    started = time.perf_counter()
    try:
        from trainer.config import parse_args

        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # the worker reports bad arguments
            try:
                _, cfg = parse_args(argv)
            except (SystemExit, ValueError):
                return 0
        if not uses_triton(cfg):
            return 0
        resolve_shape(cfg)
        details = plan(cfg, int(os.environ.get("WORLD_SIZE", "1"))).compile_arguments()
        if not details["which"] and details["adamw_coef"] is None:
            return 0
        planned = time.perf_counter()
        _target_without_a_context()  # no NVML: nothing compiled ahead (never a CUDA context beside the worker's)
        from trainer import kernels

        compiled = launchers = 0
        for kernel in kernels.compile_ahead(**details):
            compiled += 1
            launchers += _launcher(kernel)
        done = time.perf_counter()
        print(f"{PROG}: {compiled} Triton kernel(s) and {launchers} launcher(s) compiled or found in the cache in "
              f"{done - started:.2f} s (imports and plan {planned - started:.2f} s, compile {done - planned:.2f} s; "
              f"{', '.join(sorted(details['which']))}{', adamw' if details['adamw_coef'] is not None else ''})",
              file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - an optimisation: the worker compiles what it needs itself
        print(f"{PROG}: nothing compiled ahead ({type(exc).__name__}: {exc})", file=sys.stderr)
    return 0


# --- stage 2: load onto the device ------------------------------------------------------------------------------

def warm_config(cfg: JobConfig, small: bool = False) -> JobConfig:
    """``cfg`` with one block and no base model's weights, every other shape of the run kept; with ``small`` also
    a vocabulary of at most ``SMALL_VOCAB``, one sequence of at most ``SMALL_TOKENS`` tokens, eager."""
    one = copy.deepcopy(cfg)
    one.model.n_layers = min(cfg.model.n_layers, 1)
    one.model.from_hf = ""
    if small:
        one.model.vocab_size = min(cfg.model.vocab_size or SMALL_VOCAB, SMALL_VOCAB)
        one.data.seq_len = min(cfg.data.seq_len, SMALL_TOKENS)
        one.train.batch_size = 1
        one.train.compile = False
    return one


def estimate_bytes(cfg: JobConfig) -> int:
    """Device memory the load stage of ``cfg`` (a ``warm_config``) needs, roughly: its parameters at
    ``BYTES_PER_PARAM`` and one batch's activations, the logits' included."""
    from trainer.model import count_params

    tokens = cfg.train.batch_size * cfg.data.seq_len
    return count_params(cfg.model)["total"] * BYTES_PER_PARAM + tokens * (cfg.model.vocab_size * 8 + cfg.model.dim * 64)


def too_little_memory(need: int, device: torch.device) -> str | None:
    """Why a warm-up needing ``need`` bytes is skipped on ``device``: less than twice that free (it runs beside a
    worker, or beside this one's model build); None when it fits."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    if free >= 2 * need:
        return None
    return (f"skipped: {free / 2**30:.1f} GiB free on {device}, the warm-up needs {need / 2**30:.1f} GiB "
            "(twice that free)")


def warm(cfg: JobConfig, device: torch.device, world_size: int, small: bool = False) -> str:
    """Stage 2 of the run of ``cfg`` at ``world_size`` ranks on ``device``, the current device of the calling
    thread, at the run's shapes or ``small`` ones (``warm_config``); returns a line for the log: what ran and how
    long it took, or why it was skipped."""
    import torch

    if device.type != "cuda":
        return "nothing to warm on the CPU"
    one = warm_config(cfg, small)
    if not small:  # a new worker, which may follow a dead one; a standby runs beside a live worker
        _wait_for_predecessor(2 * estimate_bytes(one), device)
    skipped = too_little_memory(estimate_bytes(one), device)
    if skipped:
        return skipped
    started = time.perf_counter()
    try:
        triton = _model_pass(one, device)
        optimizer = _optimizer_pass(plan(cfg, world_size, device), device)
        torch.cuda.synchronize(device)
    finally:
        torch.cuda.empty_cache()
    kernels = ", ".join(sorted(triton)) or "none"
    return (f"warmed on {device} in {time.perf_counter() - started:.2f} s (one block: {one.train.batch_size} x "
            f"{one.data.seq_len} tokens, vocabulary {one.model.vocab_size}; Triton kernels: {kernels}; optimizer: "
            f"{optimizer})")


def _wait_for_predecessor(need: int, device: torch.device) -> None:
    """Where this rank's previous worker recorded its memory (it died, and the kernel may still be releasing what it
    held), wait up to ``PREDECESSOR_WAIT_S`` for ``need`` bytes of it (``trainer/resiliency/device.py``); the start's
    own wait for the whole need comes before the model's build, beside this."""
    from trainer.resiliency import device as device_handover

    with contextlib.suppress(device_handover.DeviceHeld):
        device_handover.wait_for_predecessor(device.index or 0, PREDECESSOR_WAIT_S, "the start's warm-up", at_most=need)


def _model_pass(one: JobConfig, device: torch.device) -> frozenset[str]:
    """One forward and backward of ``one``'s model in the compute dtype, the gradients' norms; returns the Triton
    kernels it ran (``parallel.set_kernels``)."""
    import torch
    from torch import nn

    from trainer import parallel
    from trainer.model import Transformer

    with torch.device("meta"):
        model = Transformer(one.model, max_seq_len=one.data.seq_len)
    model.to_empty(device=device)
    model.init_weights(one.train.seed)  # its own generator: no RNG stream of the run is drawn from
    dtype = parallel.mixed_precision(one.train, device).param_dtype or torch.float32
    for module in model.modules():  # what OneRank / FSDP2 hand the forward: compute-dtype parameters
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.detach().to(dtype))
    triton = parallel.set_kernels(model, one.train, device)
    tokens = torch.zeros((one.train.batch_size, one.data.seq_len), dtype=torch.long, device=device)
    with torch.enable_grad():
        model(tokens, tokens).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return triton


def _optimizer_pass(planned: Plan, device: torch.device) -> str:
    """The optimizer's kernel (and OneRank's upcast where it runs) on stand-ins of the run's integer classes."""
    import torch

    from trainer.optimizer import ADAMW_OPTIONS

    coef = torch.ones(1, device=device) if planned.clip else None
    sizes = integer_classes(planned.param_numels)
    for n in sizes:
        param, grad = torch.zeros(n, device=device), torch.zeros(n, device=device, dtype=planned.dtype)
        if planned.adamw == "triton":  # with one rank it reads OneRank's compute-dtype gradients with clipping's
            from trainer import kernels  # coefficient; with FSDP2, the fp32 gradients (clipped already)

            kernels.adamw_step(param, grad if planned.one_rank else grad.float(), torch.zeros_like(param),
                               torch.zeros_like(param), coef if planned.one_rank else None, lr=1e-4, beta1=0.9,
                               beta2=0.95, eps=1e-8, weight_decay=0.1, step=1.0)
            continue
        if "grad_upcast" in planned.triton:
            from trainer import kernels

            kernels.scaled_upcast(grad, torch.ones(1, device=device))
        param.grad = grad.float()
        torch.optim.AdamW([param], lr=1e-4, **ADAMW_OPTIONS[planned.adamw]).step()
    return f"{planned.adamw} on {len(sizes)} size class(es)"


def for_standby(cfg: JobConfig, device: torch.device, world_size: int) -> str:
    """A warm standby's warm-up before it listens: stage 2 at small shapes, in the calling thread; its line."""
    global STANDBY_WARMED
    line = warm(cfg, device, world_size, small=True)
    STANDBY_WARMED = STANDBY_WARMED or line.startswith("warmed")
    return line


class InBackground:
    """``warm`` at the run's shapes in a daemon thread on ``device``; ``wait()`` joins it and returns its line."""

    def __init__(self, cfg: JobConfig, device: torch.device, world_size: int) -> None:
        self.line = ""
        self.thread = threading.Thread(target=self._run, args=(cfg, device, world_size), name="start-warmup",
                                       daemon=True)
        self.thread.start()

    def _run(self, cfg: JobConfig, device: torch.device, world_size: int) -> None:
        try:
            import torch

            torch.cuda.set_device(device)  # this thread's current device (Triton launches on it)
            self.line = warm(cfg, device, world_size)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the first step loads what it needs itself
            self.line = f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the first " \
                        "step loads what it needs itself"

    def wait(self) -> str:
        self.thread.join()
        return self.line


def for_new_worker(cfg: JobConfig, device: torch.device, world_size: int) -> InBackground | None:
    """A new worker's warm-up in the background, or None where it is off or has nothing to do (see the module's
    docstring)."""
    if not cfg.resiliency.start_warmup or device.type != "cuda" or cfg.train.compile or STANDBY_WARMED:
        return None
    return InBackground(cfg, device, world_size)


if __name__ == "__main__":
    raise SystemExit(compile_ahead(sys.argv[1:]))
