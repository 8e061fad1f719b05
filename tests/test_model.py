"""model.py against references: causality, GQA = MHA with repeated K/V, meta init = eager init,
RMSNorm and RoPE against their textbook definitions, parameter count against the module tree."""

import pytest
import torch

from model import PRESETS, ModelArgs, RMSNorm, Transformer, apply_rope, flops_per_token, num_params, rope_tables

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, max_seq_len=32)


def test_causal_later_tokens_never_change_earlier_logits():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SMALL))
    x = torch.randint(0, 97, (2, 16))
    y = x.clone()
    y[:, 9:] = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_gqa_equals_mha_with_repeated_kv():
    gqa = Transformer(ModelArgs(**SMALL))
    gqa.init_weights(seed=1)
    mha = Transformer(ModelArgs(**{**SMALL, "n_kv_heads": 4}))
    sd = gqa.state_dict()
    head_dim, rep = 16, 2
    for k in list(sd):
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            w = sd[k].view(2, head_dim, 64)  # (kv_heads, head_dim, dim): each KV head serves `rep` query heads
            sd[k] = w.repeat_interleave(rep, dim=0).reshape(4 * head_dim, 64)
    mha.load_state_dict(sd)
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_meta_build_then_init_equals_eager_build_bit_for_bit():
    args = ModelArgs(**SMALL)
    eager = Transformer(args)
    eager.init_weights(seed=7)
    with torch.device("meta"):
        lazy = Transformer(args)
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=7)
    for (n1, t1), (n2, t2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    for (n1, b1), (n2, b2) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert n1 == n2 and torch.equal(b1, b2), n1
    assert lazy.rope_cos.dtype == torch.float32


def test_init_depends_on_seed_and_never_repeats_across_layers():
    model = Transformer(ModelArgs(**SMALL))
    model.init_weights(seed=0)
    a = model.layers[0].attention.wq.weight.clone()
    assert not torch.equal(a, model.layers[1].attention.wq.weight)
    model.init_weights(seed=1)
    assert not torch.equal(a, model.layers[0].attention.wq.weight)
    model.init_weights(seed=0)
    assert torch.equal(a, model.layers[0].attention.wq.weight)
    w = model.layers[0].attention.wq.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(model.norm.weight, torch.ones(64))


def test_rmsnorm_matches_definition():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data = torch.randn(8)
    x = torch.randn(3, 8, dtype=torch.float64)
    ref = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x.float()).double(), ref, rtol=1e-6, atol=1e-6)


def test_rope_matches_complex_rotation_and_keeps_norm():
    head_dim, seq = 8, 5
    cos, sin = rope_tables(head_dim, 16, 10_000.0)
    x = torch.randn(1, seq, 2, head_dim)
    out = apply_rope(x, cos, sin)
    # rotate-half layout: pair (i, i + d/2) is the complex number x_i + j x_{i+d/2}, rotated by m * theta_i
    half = head_dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    theta = 10_000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * theta[None]
    rz = z * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    ref = torch.cat((rz.real, rz.imag), dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_rope_tables_are_fp32_and_rope_runs_in_fp32_for_bf16_inputs():
    cos, sin = rope_tables(8, 16, 10_000.0)
    assert cos.dtype == sin.dtype == torch.float32
    x = torch.randn(1, 16, 2, 8)
    out_bf16 = apply_rope(x.bfloat16(), cos, sin)
    assert out_bf16.dtype == torch.bfloat16
    # Only the final rounding to bf16 differs from the fp32 result.
    ref = apply_rope(x.bfloat16().float(), cos, sin)
    torch.testing.assert_close(out_bf16.float(), ref.bfloat16().float())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_param_count_matches_module_tree(preset):
    args = ModelArgs(**PRESETS[preset])
    with torch.device("meta"):
        model = Transformer(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    assert num_params(args, exclude_embedding=True) == num_params(args) - args.vocab_size * args.dim


def test_flops_per_token_is_palm_formula():
    args = ModelArgs(**SMALL)
    n = sum(p.numel() for name, p in Transformer(args).named_parameters() if "tok_embeddings" not in name)
    assert flops_per_token(args, 32) == 6 * n + 12 * 2 * 4 * 16 * 32


def test_seed_document_preset_shapes():
    a = ModelArgs(**PRESETS["llama_125m"])
    assert (a.vocab_size, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.max_seq_len) == \
        (50_000, 768, 12, 12, 3, 3072, 2048)


@pytest.mark.parametrize("bad, msg", [
    (dict(dim=65), "divisible by model.n_heads"),
    (dict(n_kv_heads=3), "divisible by model.n_kv_heads"),
    (dict(vocab_size=0), "model.vocab_size must be > 0"),
    (dict(dim=12, n_heads=4, n_kv_heads=2), "must be even"),
])
def test_invalid_shapes_are_rejected_with_the_field_name(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ModelArgs(**{**SMALL, **bad})


def test_sequence_longer_than_rope_table_is_rejected():
    model = Transformer(ModelArgs(**SMALL))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_model_does_not_import_torch_distributed():
    import ast
    import pathlib
    src = (pathlib.Path(__file__).parent.parent / "model.py").read_text()
    names = [a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("torch.distributed")]
