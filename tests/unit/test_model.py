import torch

from trainer.config import ModelConfig, load_config
from trainer.model import Transformer, apply_rope, count_params, flops_per_token, rope_tables


def _tiny(vocab=4096):
    cfg = load_config("tiny", ["--data.path=/d"]).model
    cfg.vocab_size = vocab
    return cfg


def test_shapes_and_param_count_match_config():
    cfg = _tiny()
    model = Transformer(cfg, max_seq_len=64)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    assert model(tokens).shape == (2, 64, cfg.vocab_size)
    n = sum(p.numel() for p in model.parameters())
    assert n == count_params(cfg)["total"]
    assert n <= 10_000_000, "the tiny flavour must stay <= 10M parameters"


def test_flavour_sizes():
    for name, low, high in (("1b", 1.0e9, 1.6e9), ("8b", 7.5e9, 8.5e9)):
        cfg = load_config(name, ["--data.path=/d"]).model
        total = count_params(cfg)["total"]
        assert low < total < high, (name, total)
    # Llama 3 8B has 8.03B parameters with its 128256 vocabulary.
    assert abs(count_params(load_config("8b", ["--data.path=/d"]).model)["total"] - 8.03e9) < 0.01e9


def test_gqa_uses_fewer_kv_params():
    cfg = _tiny()
    attn = Transformer(cfg, 16).layers[0].attention
    assert attn.wk.weight.shape[0] == cfg.n_kv_heads * (cfg.dim // cfg.n_heads)
    assert attn.wq.weight.shape[0] == cfg.dim


def test_causal_no_future_leak():
    cfg = _tiny(128)
    model = Transformer(cfg, 32)
    model.init_weights(0)
    a = torch.randint(0, 128, (1, 32))
    b = a.clone()
    b[0, 20:] = (b[0, 20:] + 1) % 128
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.equal(la[0, :20], lb[0, :20])
    assert not torch.equal(la[0, 20:], lb[0, 20:])


def test_init_is_deterministic_and_seed_dependent():
    cfg = _tiny(256)
    m1, m2, m3 = (Transformer(cfg, 16) for _ in range(3))
    m1.init_weights(3); m2.init_weights(3); m3.init_weights(4)
    for (n, p1), p2, p3 in zip(m1.named_parameters(), m2.parameters(), m3.parameters()):
        assert torch.equal(p1, p2), n
    assert not torch.equal(m1.output.weight, m3.output.weight)


def test_rope_preserves_norm_and_is_relative():
    tables = rope_tables(8, 16, 10000.0)
    x = torch.randn(1, 16, 2, 8)
    y = apply_rope(x, tables)
    assert torch.allclose(x.norm(dim=-1), y.norm(dim=-1), atol=1e-5)
    q, k = torch.randn(8), torch.randn(8)
    def dot(i, j):
        qi = apply_rope(q.expand(1, 16, 1, 8).contiguous(), tables)[0, i, 0]
        kj = apply_rope(k.expand(1, 16, 1, 8).contiguous(), tables)[0, j, 0]
        return qi @ kj
    assert torch.allclose(dot(5, 3), dot(9, 7), atol=1e-5)


def test_flops_per_token_counts_attention():
    cfg = _tiny()
    assert flops_per_token(cfg, 1024) > flops_per_token(cfg, 128) > 6 * count_params(cfg)["non_embedding"]
