"""Our Llama <-> Hugging Face ``LlamaForCausalLM``: parameter names (as data), the q/k RoPE permutation, and
``config.json`` <-> ``ModelConfig``.

Names map as transformers' ``convert_llama_weights_to_hf`` maps Meta's checkpoints, which our model follows.
Our ``apply_rope`` rotates adjacent channel pairs (Meta's layout); transformers' rotates the first half of each
head against the second, so the rows of ``wq`` / ``wk`` are permuted within each head on the way out and back on
the way in. The permutation never crosses a head, so a slice of whole heads converts on its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.config import ModelConfig
from trainer.config_checks import ConfigError

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"


def rope_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection, Meta's interleaved pairs -> Hugging Face halves (``n_heads`` whole heads)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``rope_to_hf``."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaAdapter:
    """Our state-dict names <-> ``LlamaForCausalLM``'s, for one model shape.

    ``to_hf(fqn, tensor)`` / ``from_hf(hf_name, tensor)`` convert one tensor (name and, for q/k, row order);
    ``hf_name(fqn)`` / ``rope_heads(fqn)`` let a reader fetch only the rows it needs."""

    TOP = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    """Ours -> Hugging Face, outside the blocks. A tied model has no ``output.weight`` and writes no ``lm_head``."""
    LAYER = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    """Ours -> Hugging Face, inside block N: ``layers.N.<key>`` <-> ``model.layers.N.<value>``."""
    ROPE_PERMUTED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads"}
    """Block parameters whose rows are permuted, and the ``ModelConfig`` field that counts their heads."""
    IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
    """Hugging Face tensors that carry nothing to load (buffers older transformers versions saved)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self._to_hf: dict[str, str] = {}
        self._heads: dict[str, int] = {}
        for ours, theirs in self.TOP.items():
            if not (ours == "output.weight" and cfg.tie_embeddings):
                self._to_hf[ours] = theirs
        for n in range(cfg.n_layers):
            for ours, theirs in self.LAYER.items():
                self._to_hf[f"layers.{n}.{ours}"] = f"model.layers.{n}.{theirs}"
                if ours in self.ROPE_PERMUTED:
                    self._heads[f"layers.{n}.{ours}"] = getattr(cfg, self.ROPE_PERMUTED[ours])
        self._from_hf = {theirs: ours for ours, theirs in self._to_hf.items()}

    @property
    def fqns(self) -> list[str]:
        """Our names, embedding first, head last."""
        order = ["tok_embeddings.weight"] + [k for k in self._to_hf if k.startswith("layers.")]
        return order + [k for k in ("norm.weight", "output.weight") if k in self._to_hf]

    def hf_name(self, fqn: str) -> str:
        if fqn not in self._to_hf:
            raise KeyError(f"{fqn!r} is not a parameter of this Llama shape")
        return self._to_hf[fqn]

    def fqn(self, hf_name: str) -> str | None:
        """Our name for a Hugging Face tensor; None for one that loads into nothing (``lm_head`` of a tied model,
        rotary buffers)."""
        return self._from_hf.get(hf_name)

    def rope_heads(self, fqn: str) -> int:
        """Heads of a q/k projection whose rows are permuted; 0 for every other parameter."""
        return self._heads.get(fqn, 0)

    def head_dim(self) -> int:
        return self.cfg.dim // self.cfg.n_heads

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        heads = self.rope_heads(fqn)
        return self.hf_name(fqn), rope_to_hf(tensor, heads) if heads else tensor

    def from_hf(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        fqn = self.fqn(hf_name)
        if fqn is None:
            raise KeyError(f"{hf_name!r} has no parameter in this model")
        heads = self.rope_heads(fqn)
        return fqn, rope_from_hf(tensor, heads) if heads else tensor

    def ignorable(self, hf_name: str) -> bool:
        """A tensor a Hugging Face file may hold that this model does not load (a tied model's ``lm_head``)."""
        return hf_name.endswith(self.IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and self.cfg.tie_embeddings)


# ---- config.json <-> ModelConfig ------------------------------------------------------------------------------
def shape_from_hf(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Llama ``config.json`` sets, checked; a ``ConfigError`` names what is not a
    Llama this trainer can load. ``where`` names the file in messages. Reads both spellings of RoPE settings:
    ``rope_theta`` + ``rope_scaling`` (the Hub's Llama 3.x files) and ``rope_parameters`` (transformers 5)."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE or (archs and ARCHITECTURE not in archs):
        what = ", ".join(archs) or "no architectures"
        raise ConfigError(
            f"model.from_hf: {where} describes {what} (model_type {model_type!r}); only Llama-family causal LMs "
            f"({ARCHITECTURE}, model_type 'llama') load; choose a Llama checkpoint")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ConfigError(f"model.from_hf: {where} has {key}: true; this trainer's Llama has no biases; "
                              "choose a checkpoint without them")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"model.from_hf: {where} has hidden_act {config['hidden_act']!r}; only 'silu' (SwiGLU) "
                          "is supported")
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        shape: dict[str, Any] = {
            "dim": dim,
            "n_layers": int(config["num_hidden_layers"]),
            "n_heads": heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "ffn_dim": int(config["intermediate_size"]),
            "vocab_size": int(config["vocab_size"]),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
            "init_std": float(config.get("initializer_range", 0.02)),
        }
    except KeyError as exc:
        raise ConfigError(f"model.from_hf: {where} has no {exc.args[0]!r}; it is not a complete Llama config") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.from_hf: {where} holds a value of the wrong type ({exc})") from None
    head_dim = config.get("head_dim")
    if head_dim is not None and (dim % heads or int(head_dim) != dim // heads):
        raise ConfigError(
            f"model.from_hf: {where} has head_dim {head_dim}, but hidden_size / num_attention_heads = "
            f"{dim} / {heads}; this trainer derives the head size from them, so they must agree")
    shape.update(_rope_from_hf(config, where, shape["max_position_embeddings"]))
    return shape


def _rope_from_hf(config: dict[str, Any], where: str, max_positions: int) -> dict[str, Any]:
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"model.from_hf: {where}: rope_scaling must be an object or null; got {params!r}")
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError(f"model.from_hf: {where} rotates only part of each head (partial_rotary_factor); "
                          "not supported")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_factor": 0.0}
    if kind == "default":
        return out
    if kind != "llama3":
        raise ConfigError(f"model.from_hf: {where} uses RoPE scaling {kind!r}; only Llama 3.1's 'llama3' (or none) "
                          "is supported")
    try:
        out.update(
            rope_scaling_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_len=int(params.get("original_max_position_embeddings", max_positions)),
        )
    except KeyError as exc:
        raise ConfigError(f"model.from_hf: {where}: rope scaling 'llama3' needs {exc.args[0]!r}") from None
    return out


def hf_config(cfg: ModelConfig, seq_len: int, dtype: torch.dtype, bos_id: int | None,
              eos_id: int | None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with our shape (the legacy RoPE spelling: every transformers
    version and vLLM read it)."""
    rope_scaling = None
    if cfg.rope_scaling_factor:
        rope_scaling = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings or seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def head_rows(offset: int, rows: int, head_dim: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the whole heads that rows ``[offset, offset + rows)`` touch."""
    return offset // head_dim * head_dim, math.ceil((offset + rows) / head_dim) * head_dim
