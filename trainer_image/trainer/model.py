"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention via ``scaled_dot_product_attention``.

Plain PyTorch, no parallelism: ``parallel.py`` shards it with FSDP2.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig


class RMSNorm(nn.Module):
    """``F.rms_norm``: one fused kernel on GPU, fp32 arithmetic inside whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device | None = None, scaling: "RopeScaling | None" = None
) -> torch.Tensor:
    """cos/sin tables of shape ``[seq_len, head_dim // 2, 2]`` (fp32); ``scaling``: Llama 3.1 frequency scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Meta's ``apply_scaling``; Hugging Face ``rope_type: "llama3"``).

    Wavelengths longer than ``original_len / low_freq_factor`` are stretched by ``factor``; shorter than
    ``original_len / high_freq_factor`` are kept; in between, the frequency is interpolated linearly in
    ``original_len / wavelength`` between the two."""

    def __init__(self, factor: float, low_freq_factor: float, high_freq_factor: float, original_len: int) -> None:
        self.factor, self.low, self.high, self.original_len = factor, low_freq_factor, high_freq_factor, original_len

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "RopeScaling | None":
        """None when ``rope_scaling_factor`` is 0 (no scaling: the tables are bit-identical to unscaled ones)."""
        if not cfg.rope_scaling_factor:
            return None
        return cls(cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                   cfg.rope_original_max_len)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_len / wavelen - self.low) / (self.high - self.low)
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelen > self.original_len / self.low, inv_freq / self.factor, inv_freq)
        in_band = (wavelen >= self.original_len / self.high) & (wavelen <= self.original_len / self.low)
        return torch.where(in_band, between, out)


def apply_rope(x: torch.Tensor, tables: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """Rotate pairs of channels of ``x`` ``[batch, seq, heads, head_dim]`` by position-dependent angles, in fp32.

    ``kernel`` (``train.rope_kernel``, resolved by ``parallel.apply_fsdp``): ``complex`` (and ``auto``): one complex
    multiplication (a single kernel in eager mode; compiled, it runs outside Inductor's graphs); ``real``:
    ``(a cos - b sin, a sin + b cos)``, which Inductor fuses with its neighbours (the compiled default: see the config
    key)."""
    seq = x.shape[1]
    if kernel == "real":
        cos, sin = (tables[:seq, :, i].float().view(1, seq, 1, -1) for i in (0, 1))
        a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)
    rotation = torch.view_as_complex(tables[:seq].float()).view(1, seq, 1, -1)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


class Attention(nn.Module):
    rope_kernel = "auto"
    """``apply_rope``'s kernel; set from ``train.rope_kernel`` (``parallel.apply_fsdp``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, rope, self.rope_kernel), apply_rope(k, rope, self.rope_kernel)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


class FeedForward(nn.Module):
    activation = staticmethod(swiglu)
    """``silu(w1 x) * w3 x``; replaced by ``trainer/kernels.py``'s one-kernel version by ``train.kernels``
    (``parallel.apply_fsdp``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype. Compiled (``train.compile``),
    the upcast is fused into the softmax reduction: no fp32 copy of the ``[tokens, vocab]`` logits is made."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class Transformer(nn.Module):
    """Decoder-only language model. ``forward(tokens) -> logits`` (``[batch, seq, vocab]``);
    ``forward(tokens, targets) -> loss``: the logits then live only inside the call.

    With ``tie_embeddings`` there is no ``output`` module: the head multiplies by ``tok_embeddings.weight``, so the
    tied weight has one name in every state dict, one optimizer state and one FSDP unit (``parallel.apply_fsdp``)."""

    loss_fn = staticmethod(cross_entropy)
    """Replaced by ``train.chunked_loss``'s choice, compiled with ``train.compile`` (``parallel.apply_fsdp``)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", self._rope_tables(), persistent=False)

    def _rope_tables(self, device: torch.device | None = None) -> torch.Tensor:
        cfg = self.cfg
        return rope_tables(cfg.dim // cfg.n_heads, self.max_seq_len, cfg.rope_theta, device, RopeScaling.from_config(cfg))

    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed``: the same weights on every rank and every world size."""
        gen = torch.Generator(device=self.tok_embeddings.weight.device).manual_seed(seed)
        std = self.cfg.init_std
        # Residual projections are scaled down with depth (GPT-2 / Llama practice).
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(("wo.weight", "w2.weight")):
                    param.normal_(0.0, out_std, generator=gen)
                else:
                    param.normal_(0.0, std, generator=gen)
            self.rope.copy_(self._rope_tables(self.rope.device))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        h = self.norm(h)
        logits = F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)
        return logits if targets is None else self.loss_fn(logits, targets)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts computed from the config alone (no model needed). A tied head adds no parameters."""
    head_dim = cfg.dim // cfg.n_heads
    attn = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    ffn = 3 * cfg.dim * cfg.ffn_dim
    block = attn + ffn + 2 * cfg.dim
    embedding = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    total = embedding + cfg.n_layers * block + cfg.dim + head
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x non-embedding params plus causal attention.

    Attention scores and values cost ``2 * 2 * seq_len * dim`` FLOPs per layer and token forward when not
    masked; the same convention as torchtitan and the PaLM paper (``12 * L * d * T`` for fwd+bwd) is used.
    """
    params = count_params(cfg)["non_embedding"] + (cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0)  # the head
    return 6.0 * params + 12.0 * cfg.n_layers * cfg.dim * seq_len
