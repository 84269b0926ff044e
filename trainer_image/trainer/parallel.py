"""Process group and FSDP2 sharding. Backend from the device: NCCL with one GPU per process, gloo on CPU."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer import loss
from trainer.config import ConfigError, TrainConfig, accumulation
from trainer.onerank import OneRank, clip_grad_norm_  # noqa: F401  (re-exported for the loop)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits; read from the launcher's environment (torchrun, ft_launcher, PyTorchJob)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def wants_cuda(cfg: TrainConfig) -> bool:
    """Whether ``select_device`` will pick a GPU (asked without making a CUDA context)."""
    return cfg.device != "cpu" and torch.cuda.is_available()


def select_device(cfg: TrainConfig, env: DistEnv) -> torch.device:
    if not wants_cuda(cfg):
        if cfg.device == "cuda":
            raise RuntimeError("train.device=cuda but no CUDA device is visible; use --train.device=cpu")
        threads = cfg.cpu_threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
        torch.set_num_threads(threads)
        return torch.device("cpu")
    if env.local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"local rank {env.local_rank} has no GPU: {torch.cuda.device_count()} visible; "
            "set nproc_per_node to at most the number of GPUs per node"
        )
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    device: torch.device, env: DistEnv, timeout_s: float, store: dist.Store | None = None
) -> None:
    """Initialise the default process group. ``store`` lets the in-process restart layer pass a fresh
    ``PrefixStore`` each iteration; without one the launcher's env rendezvous is used.

    NCCL with more than one rank: the communicator is made here (``device_id``), not by the first collective. With
    one rank it is left to the first collective, and ``OneRank`` (one rank's default) runs none on this group (nor
    the loss or preemption reductions), so none is made: the in-process restart's abort has nothing to tear down
    (NVRx's abort of a one-rank communicator: 0.8-1.0 s on an H200, ``bench/onerank_probe.py abort``). FSDP2 at one
    rank (``train.single_rank=fsdp``, activation checkpointing) makes it at its first all-gather."""
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict = {"backend": backend_for(device), "timeout": timeout}
    before = _socket_inodes() if device.type != "cuda" else {}
    if device.type == "cuda" and env.world_size > 1:  # one rank: made by a first collective, if any (above)
        kwargs["device_id"] = device
    if store is not None:
        dist.init_process_group(store=store, rank=env.rank, world_size=env.world_size, **kwargs)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(init_method="env://", rank=env.rank, world_size=env.world_size, **kwargs)
    else:  # a single process with no launcher: a private in-memory store
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    if device.type != "cuda":  # gloo connects its full mesh at init: these are its connections to the peers
        _GLOO_CONNECTIONS[:] = [(fd, inode) for fd, inode in _socket_inodes().items()
                                if before.get(fd) != inode and not _is_store_connection(fd)]


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this one rank for the length of the block (the model's sharding asks for one), unless one
    exists already; gone after: what the GPU benches use to build the model outside a launcher."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


def abort_process_group() -> None:
    """Leave the default group at once: a peer blocked in one of its collectives fails now, not at the timeout.

    On gloo a destroyed or aborted group keeps its connections open while FSDP2 still references it (measured:
    the peer stayed blocked until the gloo timeout), so its sockets, recorded at init, are shut down first."""
    for fd, inode in _GLOO_CONNECTIONS:
        # still the same socket (the fd was not reused), and still open when wrapped
        if _socket_inodes([fd]).get(fd) == inode and (sock := _borrow(fd)) is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.detach()  # gloo still owns the descriptor
    _GLOO_CONNECTIONS.clear()
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


_GLOO_CONNECTIONS: list[tuple[int, str]] = []
"""(fd, socket inode) of the default gloo group's connections to its peers, recorded at init."""


def _socket_inodes(fds: list[int] | None = None) -> dict[int, str]:
    out = {}
    for fd in fds if fds is not None else [int(f) for f in os.listdir("/proc/self/fd")]:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[fd] = target
    return out


def _borrow(fd: int) -> socket.socket | None:
    """A socket object over ``fd`` (``detach()`` it after use: its owner keeps the descriptor); None when the fd was
    closed meanwhile by another thread (gloo's, a store's): the scan races with them. Wrapping a closed fd raised
    EBADF inside the wrapped training function, an in-process restart that no fault caused."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


def _is_store_connection(fd: int) -> bool:
    """A TCPStore connection (the launcher's or the in-process layer's, on MASTER_PORT and the next ports) must
    never be shut down; gloo's peer connections use ephemeral ports."""
    master_port = int(os.environ.get("MASTER_PORT", "0"))
    store_ports = {master_port + i for i in range(4)} if master_port else set()  # the agent's, +1, +2 (resiliency)
    sock = _borrow(fd)
    if sock is None:
        return True  # gone: nothing to record
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return True  # e.g. ft_launcher's unix-domain IPC: leave it alone
        ports = {sock.getsockname()[1], sock.getpeername()[1]}
    except OSError:
        return True  # not a connected TCP socket: leave it alone
    finally:
        sock.detach()
    return bool(ports & store_ports)


def mixed_precision(cfg: TrainConfig, device: torch.device) -> MixedPrecisionPolicy:
    mode = cfg.mixed_precision
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" else "fp32"
    if mode == "bf16":
        # No cast of forward inputs: the activations are bf16 already (the embedding's output), and the fp32
        # RoPE tables passed to every block must stay fp32.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def rope_kernel(cfg: TrainConfig) -> str:
    """``train.rope_kernel`` resolved: ``auto`` is ``real`` when compiled (Inductor fuses it with the projections),
    ``complex`` in eager mode (one kernel)."""
    if cfg.rope_kernel != "auto":
        return cfg.rope_kernel
    return "real" if cfg.compile else "complex"


def one_rank_direct(cfg: TrainConfig, world_size: int) -> bool:
    """``OneRank`` instead of FSDP2 (``train.single_rank``): one rank, and ``direct``, or ``auto`` without
    activation checkpointing nor gradient accumulation (``OneRank`` finishes, and clips, the gradients at the end
    of every backward: one backward per optimizer step)."""
    return world_size == 1 and (cfg.single_rank == "direct" or (
        cfg.single_rank == "auto" and not cfg.activation_checkpointing and accumulation(cfg, world_size) == 1))


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2: whether this backward reduce-scatters the gradients (the last micro-batch of a step) or accumulates
    them unsharded (the others). A model without FSDP2 accumulates in ``.grad`` either way."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def triton_missing() -> str:
    """Why Triton cannot be imported ("" when it can: it is part of PyTorch's CUDA builds)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return str(exc) or "ImportError"
    return ""


def triton_kernels(cfg: TrainConfig, device: torch.device) -> frozenset[str]:
    """``train.kernels`` resolved: which of ``trainer/kernels.py``'s run: ``loss`` and ``swiglu`` in eager mode;
    compiled, ``loss`` (instead of Inductor's chunk kernels: faster a step on one H200) and
    ``grad_upcast`` (one rank's gradient pass, outside the compiled graphs); none on CPU."""
    if cfg.kernels == "torch" or device.type != "cuda":
        return frozenset()
    missing = triton_missing()
    if missing:
        if cfg.kernels == "triton":
            raise ConfigError(f"train.kernels=triton needs Triton ({missing}): install it, or set train.kernels=auto")
        return frozenset()
    if not cfg.compile:
        return frozenset({"loss", "swiglu", "grad_upcast"})
    return frozenset({"loss", "grad_upcast"})


def set_kernels(model: nn.Module, cfg: TrainConfig, device: torch.device) -> frozenset[str]:
    """The kernels of ``[train]`` on an unwrapped ``model``: each block's RoPE kernel and activation (the Triton
    SwiGLU), and the loss; returns the Triton kernels that run (``triton_kernels``). Used by ``apply_fsdp`` and by
    the warm-up of a process's kernels (``trainer/startup/warmup.py``)."""
    triton = triton_kernels(cfg, device)
    if triton:
        from trainer import kernels
    for block in model.layers:  # type: ignore[attr-defined]
        block.attention.rope_kernel = rope_kernel(cfg)
        if "swiglu" in triton:
            block.feed_forward.activation = kernels.swiglu
    model.loss_fn = loss.build(cfg.chunked_loss, compiled=cfg.compile and cfg.compile_loss,  # type: ignore[assignment]
                               plain=model.loss_fn, triton="loss" in triton)
    return triton


def apply_fsdp(model: nn.Module, cfg: TrainConfig, device: torch.device, grad_clip: float = 0.0) -> nn.Module:
    """The execution choices of ``[train]``: the RoPE kernel and the loss, activation checkpointing and
    ``torch.compile`` per block (optional), then FSDP2 units: each block, the embedding, [final norm, output],
    and the root; or, with one rank, ``OneRank`` instead of FSDP2 (``train.single_rank``), which clips the
    gradients at ``grad_clip`` as it converts them at the end of each backward (``clip_grad_norm_``).

    Own units for the embedding and the head let their gathers and reductions overlap with the blocks' compute
    instead of running with the root's. A tied embedding (``model.tie_embeddings``) is used by the first and the
    last computation of the forward, so it must stay gathered in between: it and the final norm belong to the root
    unit (gathered for the whole forward and backward, reduced once), never to a unit resharded after its forward.
    If FSDP2 runs with one rank (``train.single_rank=fsdp``, or activation checkpointing), by default
    (``train.reshard_after_forward=auto``) nothing is resharded after the forward: the bf16 copies are kept for the
    backward rather than cast again. ``OneRank`` does reshard by default (``auto`` and ``always``): every block but
    the last frees its compute-dtype copies after its forward and casts them again for its backward (memory at the
    step's peak for one more cast; ``never`` keeps them).
    """
    policy = mixed_precision(cfg, device)
    direct = one_rank_direct(cfg, dist.get_world_size())
    # auto: FSDP2 with more ranks (with one, its gather again is a copy that costs time); OneRank always (a cast)
    reshard = {"auto": dist.get_world_size() > 1 or direct, "always": True, "never": False}[cfg.reshard_after_forward]
    layers = model.layers  # type: ignore[attr-defined]
    triton = set_kernels(model, cfg, device)
    for idx, block in enumerate(layers):
        if cfg.activation_checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if cfg.compile:
            block = torch.compile(block)
        if not direct:  # the last block's parameters are needed again right away by the backward; keep them
            fully_shard(block, mp_policy=policy, reshard_after_forward=reshard and idx < len(layers) - 1)
        layers[idx] = block
    if cfg.compile and cfg.compile_loss:
        model.norm = torch.compile(model.norm)  # type: ignore[assignment]
    if direct:
        blocks = list(layers)[:-1] if reshard else []  # the last one: as above
        upcast = None
        if "grad_upcast" in triton:
            from trainer.kernels import scaled_upcast as upcast
        return OneRank.apply(model, policy.param_dtype or torch.float32, device, grad_clip, reshard_blocks=blocks,
                             scaled_upcast=upcast)
    if model.output is not None:  # untied; tied: the embedding and the norm stay with the root
        fully_shard(model.tok_embeddings, mp_policy=policy, reshard_after_forward=reshard)  # type: ignore[arg-type]
        fully_shard([model.norm, model.output], mp_policy=policy, reshard_after_forward=False)  # type: ignore[list-item]
    fully_shard(model, mp_policy=policy)
    return model
