"""The Hugging Face adapter without a process group: names, the q/k permutation, config.json <-> ModelConfig, and
Llama 3.1 RoPE scaling against transformers' own implementation."""

import json

import pytest
import torch

from hf_models import SCALING, make_llama
from trainer.config import ConfigError, ModelConfig
from trainer.hf.adapter import LlamaAdapter, hf_config, rope_from_hf, rope_to_hf, shape_from_hf
from trainer.model import RopeScaling, Transformer, apply_rope, rope_tables


def _cfg(**kw) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)
    return ModelConfig(**{**base, **kw})


def test_permutation_is_transformers_layout_and_inverts():
    """Meta's interleaved pair (2i, 2i+1) of a head becomes rows (i, i + head_dim/2) of that head in Hugging Face's
    rotate-half layout; ``rope_from_hf`` undoes it exactly, head by head."""
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim, dtype=torch.float32).unsqueeze(1).repeat(1, cols)
    hf = rope_to_hf(w, heads)
    for h in range(heads):
        for i in range(head_dim // 2):
            assert hf[h * head_dim + i, 0] == h * head_dim + 2 * i
            assert hf[h * head_dim + head_dim // 2 + i, 0] == h * head_dim + 2 * i + 1
    assert torch.equal(rope_from_hf(hf, heads), w)
    # A slice of whole heads converts on its own (what a rank reading its rows relies on).
    assert torch.equal(rope_from_hf(hf[head_dim : 3 * head_dim], 2), w[head_dim : 3 * head_dim])


def test_rope_attention_scores_agree_with_transformers_rotate_half():
    """Our pairwise rotation with Meta-layout weights gives the same q.k scores as transformers' rotate-half RoPE
    with the permuted weights: the permutation is the right one for our ``apply_rope``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, head_dim, dim, seq = 2, 8, 16, 12
    wq, wk, x = torch.randn(heads * head_dim, dim), torch.randn(heads * head_dim, dim), torch.randn(1, seq, dim)
    tables = rope_tables(head_dim, seq, 10000.0)
    q = apply_rope((x @ wq.T).view(1, seq, heads, head_dim), tables).transpose(1, 2)
    k = apply_rope((x @ wk.T).view(1, seq, heads, head_dim), tables).transpose(1, 2)
    ours = q @ k.transpose(-1, -2)
    angles = torch.cat([tables[..., 0], tables[..., 0]], -1), torch.cat([tables[..., 1], tables[..., 1]], -1)
    hq = (x @ rope_to_hf(wq, heads).T).view(1, seq, heads, head_dim).transpose(1, 2)
    hk = (x @ rope_to_hf(wk, heads).T).view(1, seq, heads, head_dim).transpose(1, 2)
    hq, hk = apply_rotary_pos_emb(hq, hk, angles[0].unsqueeze(0), angles[1].unsqueeze(0))
    assert torch.allclose(ours, hq @ hk.transpose(-1, -2), atol=1e-4)


@pytest.mark.parametrize("flavour", ["untied-scaled", "tied"])
def test_names_cover_a_transformers_llama_both_ways(tmp_path, flavour):
    from hf_models import safetensors_dict

    hf_names = set(safetensors_dict(make_llama(tmp_path, flavour)))
    cfg = _cfg(vocab_size=2048, tie_embeddings=flavour == "tied")
    adapter = LlamaAdapter(cfg)
    ours = set(Transformer(cfg, 8).state_dict())
    assert set(adapter.fqns) == ours
    loaded = {adapter.hf_name(fqn) for fqn in adapter.fqns}
    assert loaded == {n for n in hf_names if not adapter.ignorable(n)}
    assert all(adapter.fqn(adapter.hf_name(fqn)) == fqn for fqn in adapter.fqns)
    assert ("lm_head.weight" in loaded) == (flavour != "tied")


def test_to_hf_and_from_hf_are_inverse_over_a_whole_model():
    cfg = _cfg(tie_embeddings=False)
    adapter = LlamaAdapter(cfg)
    model = Transformer(cfg, 8)
    model.init_weights(0)
    ours = model.state_dict()
    theirs = dict(adapter.to_hf(fqn, tensor) for fqn, tensor in ours.items())
    assert theirs.keys() == {adapter.hf_name(f) for f in ours}
    assert not torch.equal(theirs["model.layers.0.self_attn.q_proj.weight"], ours["layers.0.attention.wq.weight"])
    assert torch.equal(theirs["model.layers.0.self_attn.v_proj.weight"], ours["layers.0.attention.wv.weight"])
    back = dict(adapter.from_hf(name, tensor) for name, tensor in theirs.items())
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    with pytest.raises(KeyError):
        adapter.from_hf("model.layers.9.self_attn.q_proj.weight", torch.zeros(1))


def test_shape_from_transformers_config_json(tmp_path):
    """transformers 5 writes ``rope_parameters``; the Hub's Llama 3.x files have ``rope_theta`` + ``rope_scaling``:
    both give the same shape."""
    saved = json.loads((make_llama(tmp_path, "tied") / "config.json").read_text())
    shape = shape_from_hf(saved, "config.json")
    assert shape["dim"] == 64 and shape["n_layers"] == 2 and shape["n_heads"] == 4 and shape["n_kv_heads"] == 2
    assert shape["ffn_dim"] == 96 and shape["vocab_size"] == 2048 and shape["tie_embeddings"] is True
    assert shape["rope_theta"] == 500000.0 and shape["norm_eps"] == 1e-5 and shape["max_position_embeddings"] == 256
    assert (shape["rope_scaling_factor"], shape["rope_low_freq_factor"], shape["rope_high_freq_factor"],
            shape["rope_original_max_len"]) == (8.0, 1.0, 4.0, 32)
    legacy = {k: v for k, v in saved.items() if k not in ("rope_parameters",)}
    legacy.update(rope_theta=500000.0, rope_scaling={**SCALING, "rope_type": "llama3"})
    assert shape_from_hf(legacy, "config.json") == shape
    legacy.update(rope_scaling=None, rope_theta=10000.0)
    assert shape_from_hf(legacy, "config.json")["rope_scaling_factor"] == 0.0


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "only Llama-family"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "only Llama-family"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 32}, "head_dim 32"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_what_is_not_a_llama_we_load_is_one_config_error(tmp_path, change, message):
    saved = json.loads((make_llama(tmp_path, "plain") / "config.json").read_text())
    with pytest.raises(ConfigError, match=message) as err:
        shape_from_hf({**saved, **change}, "x/config.json")
    assert "\n" not in str(err.value) and "x/config.json" in str(err.value)


def test_exported_config_loads_in_transformers_with_our_shape():
    from transformers import AutoConfig

    cfg = _cfg(tie_embeddings=True, rope_scaling_factor=32.0, rope_original_max_len=8192, rope_theta=500000.0,
               max_position_embeddings=131072)
    data = hf_config(cfg, seq_len=128, dtype=torch.bfloat16, bos_id=None, eos_id=3)
    hc = AutoConfig.for_model(**data)
    assert type(hc).__name__ == "LlamaConfig"
    assert (hc.hidden_size, hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads,
            hc.intermediate_size, hc.vocab_size) == (64, 2, 4, 2, 96, 128)
    assert hc.tie_word_embeddings is True and hc.eos_token_id == 3 and hc.max_position_embeddings == 131072
    assert hc.rope_parameters["rope_type"] == "llama3" and hc.rope_parameters["factor"] == 32.0
    assert shape_from_hf(data, "config.json") == shape_from_hf(hc.to_dict(), "config.json")
    assert hf_config(_cfg(), seq_len=128, dtype=torch.float32, bos_id=1, eos_id=2)["max_position_embeddings"] == 128


def test_llama3_rope_scaling_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hc = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hc, torch.device("cpu"))
    cfg = _cfg(dim=2048, n_heads=32, n_kv_heads=8, rope_theta=500000.0, rope_scaling_factor=32.0)
    ours = torch.view_as_complex(rope_tables(64, 2, 500000.0, scaling=RopeScaling.from_config(cfg))[1]).angle()
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    # All three regimes are present at this shape: kept, stretched by the factor, interpolated.
    plain = torch.view_as_complex(rope_tables(64, 2, 500000.0)[1]).angle()
    ratio = plain / ours
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(32.0)).any()
    assert ((ratio > 1.01) & (ratio < 31.9)).any()


def test_no_scaling_and_untied_leave_the_model_bit_identical():
    """Today's flavours: the default fields build the same tables and parameters as before they existed."""
    cfg = _cfg()
    assert RopeScaling.from_config(cfg) is None
    head_dim = 16
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(32, dtype=torch.float32), inv_freq)
    assert torch.equal(rope_tables(head_dim, 32, 10000.0), torch.stack((angles.cos(), angles.sin()), dim=-1))
    model = Transformer(cfg, 32)
    model.init_weights(0)
    assert torch.equal(model.rope, torch.stack((angles.cos(), angles.sin()), dim=-1))
    assert model.output is not None and list(model.state_dict())[-1] == "output.weight"


def test_tied_model_has_one_weight_used_twice():
    cfg = _cfg(tie_embeddings=True)
    model = Transformer(cfg, 16)
    model.init_weights(0)
    assert "output.weight" not in model.state_dict() and model.output is None
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        logits = model(tokens)
        x = model.tok_embeddings(tokens)
        for layer in model.layers:
            x = layer(x, model.rope)
        assert torch.equal(logits, torch.nn.functional.linear(model.norm(x), model.tok_embeddings.weight))
