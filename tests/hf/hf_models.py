"""Small Llamas made by transformers (random weights, ``save_pretrained``) and what the tests compare with them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB = 2048  # the suite's dataset (tests/conftest.py tiny_dataset, built once per pytest session)
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
"""Llama 3.1's kind of RoPE scaling, with an original context short enough that the tests' sequences feel it."""

FLAVOURS = {
    # Llama 3.1-style: separate head, llama3 RoPE scaling.
    "untied-scaled": dict(tie_word_embeddings=False, rope_scaling=SCALING, rope_theta=500000.0),
    # Llama 3.2 1B/3B-style: tied input/output embeddings (and its RoPE scaling too).
    "tied": dict(tie_word_embeddings=True, rope_scaling=SCALING, rope_theta=500000.0),
    # Llama 2-style: no scaling, untied.
    "plain": dict(tie_word_embeddings=False, rope_theta=10000.0),
}


def make_llama(directory: Path, flavour: str = "untied-scaled", vocab: int = VOCAB, seed: int = 0,
               max_shard_size: str | None = None, save_dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random-weight ``LlamaForCausalLM`` saved with ``save_pretrained`` (safetensors) into ``directory``.

    Weights are drawn with a larger std than transformers' 0.02 so the logits are far from uniform and a wrong
    mapping or permutation changes the loss visibly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
        bos_token_id=None, eos_token_id=0, **{**FLAVOURS[flavour], **overrides},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norms: around 1, not exactly (a swapped norm would show)
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(save_dtype).save_pretrained(directory, **kwargs)
    return Path(directory)


def load_hf(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean next-token cross-entropy of a transformers model (the trainer's definition: targets given)."""
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()


def safetensors_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(path))
    return out
