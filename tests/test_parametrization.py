"""sp, mup and completep: the init and per-group LRs against the formulas written out here, the coordinate check
(flat under mup, growing under sp), a checkpoint written before parametrizations existed, and bad input."""
import json
import math
import os
import shutil
import sys

import pytest
import torch

from launch import ROOT, losses, main_in_process, train_in_process
from model import PRESETS, ModelArgs, Transformer
from optimization.optimizers import OptimConfig, build_optimizer

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import coord_check  # noqa: E402

HIDDEN_IN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
HIDDEN_OUT = ("attention.wo", "feed_forward.w2")
LR, WD, EPS = 1e-3, 0.1, 1e-8


def expected(p: str, dim: int, n_layers: int, base_dim: int, base_n_layers: int, name: str, muon: bool):
    """(init std or None, LR, weight decay, eps) of one parameter, written out from nn/parametrization.py's sources:
    Tensor Programs V's Table 3/8 for mup (hidden: std 0.02/sqrt(m), Adam LR lr/m), Dey et al. 2025's Table 1 at
    alpha = 1 for completep (residual 1/m_L, eps/(m m_L), wd*m on the hidden matrices; mup: the same at m_L = 1),
    the spectral rule for Muon."""
    m = dim / base_dim if p != "sp" else 1.0
    m_l = n_layers / base_n_layers if p == "completep" else 1.0
    hidden = name.startswith("layers.") and not name.endswith("norm.weight")
    writer = any(name.endswith(f"{h}.weight") for h in HIDDEN_OUT)
    if name.endswith("norm.weight"):
        std = None
    elif name == "output.weight":
        std = 0.02 * m  # the effective readout (a_out W / m) starts as the proxy's, entry by entry
    elif not hidden:
        std = 0.02
    elif p == "completep":
        std = 0.02 * m ** -0.5
    else:
        std = 0.02 * (m ** -0.5) * ((2 * n_layers) ** -0.5 if writer else 1.0)
    lr = LR * ((m ** -0.5 if muon else 1 / m) if hidden else 1.0)
    wd = 0.0 if name.endswith("norm.weight") else WD * LR / lr  # lr * wd: the proxy's (Wang & Aitchison 2024)
    return std, lr, wd, EPS / (m * m_l)  # every gradient shrinks as 1/m (Everett et al. 2024)


@pytest.mark.parametrize("p, base_dim, base_n_layers", [("sp", 0, 0), ("mup", 64, 0), ("completep", 64, 2)])
@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("dim, n_layers", [(128, 4), (256, 2)])
def test_init_and_per_group_settings_follow_the_formulas(p, base_dim, base_n_layers, optim, dim, n_layers):
    args = ModelArgs(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=4, vocab_size=512, ffn_dim=2 * dim,
                     max_seq_len=32, parametrization=p, base_dim=base_dim, base_n_layers=base_n_layers)
    model = Transformer(args)
    cfg = OptimConfig(name=optim, lr=LR, weight_decay=WD, eps=EPS, warmup_steps=0, schedule="wsd")
    opt, _ = build_optimizer(model, cfg, 10**6, fused=False)  # WSD's stable phase: the group LRs are the peak
    group_of = {id(q): g for g in opt.param_groups for q in g["params"]}
    for name, param in model.named_parameters():
        muon = optim == "muon" and name.startswith("layers.") and not name.endswith("norm.weight")
        std, lr, wd, eps = expected(p, dim, n_layers, base_dim, base_n_layers, name, muon)
        g = group_of[id(param)]
        assert g["lr"] == pytest.approx(lr, rel=1e-12) and g["weight_decay"] == pytest.approx(wd, rel=1e-12), name
        if not muon:
            assert g["eps"] == pytest.approx(eps, rel=1e-12), name
        if std is None:
            assert torch.equal(param.detach(), torch.ones_like(param)), name
        else:  # the drawn weights, not only the number asked for (>= 16k draws: 3% is over 5 sigma)
            assert param.detach().std().item() == pytest.approx(std, rel=0.03), name
    m = dim / base_dim if p != "sp" else 1.0
    assert model.logits_scale == pytest.approx(1 / m)
    assert model.layers[0].residual_scale == pytest.approx(base_n_layers / n_layers if p == "completep" else 1.0)
    assert model.layers[0].attention.query_scale == 1.0  # head_dim kept: sp's scores (the next test)


@pytest.mark.parametrize("base_head_dim, attn_mult", [(0, 1.0), (8, 1.0), (16, 3.0)])
def test_mup_scores_are_sp_scores_at_the_proxy_head_dim(base_head_dim, attn_mult):
    """Attention under mup against attention written out with scores attn_mult q.k sqrt(base_head_dim) / head_dim
    (microsoft/mup's attn_mult / d at attn_mult = sqrt(d_base)): sp's q.k / sqrt(head_dim) when head_dim is the
    proxy's, q.k / head_dim's 1/head_dim as head_dim grows past it (no RoPE: one position). The code before the fix
    took q.k / head_dim at every head_dim, 1/sqrt(head_dim) below sp's at the proxy."""
    args = ModelArgs(**{**PRESETS["debug"], "parametrization": "mup", "base_dim": 64, "base_head_dim": base_head_dim,
                        "mup_attn_mult": attn_mult})
    attn = Transformer(args).layers[0].attention
    x = torch.randn(2, 5, args.dim)
    cos, sin = torch.ones(5, args.head_dim), torch.zeros(5, args.head_dim)  # RoPE off: the identity rotation
    q = attn.wq(x).view(2, 5, -1, args.head_dim).transpose(1, 2)
    k = attn.wk(x).view(2, 5, -1, args.head_dim).repeat_interleave(2, dim=2).transpose(1, 2)
    v = attn.wv(x).view(2, 5, -1, args.head_dim).repeat_interleave(2, dim=2).transpose(1, 2)
    scale = attn_mult * math.sqrt(base_head_dim or args.head_dim) / args.head_dim
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, -1))
    torch.testing.assert_close(attn(x, cos, sin), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p, base_n_layers", [("mup", 0), ("completep", 2)])
def test_at_the_proxy_shape_mup_trains_as_sp(p, base_n_layers):
    """At base_dim = dim (and base_n_layers = n_layers) every multiplier is 1, so the proxy tuned under mup is the
    sp model: the same init, the same logits and the same AdamW steps, bit for bit (completep: its wo/w2 init
    differs from GPT-2's, so it is given sp's weights). Before the fix mup's scores were q.k / head_dim there, not
    sp's q.k / sqrt(head_dim)."""
    shape = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=64, max_seq_len=16)
    sp = Transformer(ModelArgs(**shape))
    other = Transformer(ModelArgs(**shape, parametrization=p, base_dim=32, base_n_layers=base_n_layers))
    other.load_state_dict(sp.state_dict())
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses_of = {}
    for name, model in (("sp", sp), (p, other)):
        cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=WD, eps=EPS, warmup_steps=0, schedule="wsd")
        opt, _ = build_optimizer(model, cfg, 10, fused=False)
        losses_of[name] = []
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses_of[name].append(loss.item())
    assert losses_of[p] == losses_of["sp"]
    for k, v in sp.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


@pytest.mark.parametrize("optim", ["adamw", pytest.param("muon", marks=pytest.mark.slow)])
def test_coordinate_check_is_flat_under_mup_and_grows_under_sp(optim):
    """benchmarks/coord_check.py, small: widths 32 ... 256 (8x), 4 steps at a large LR. After 3 updates the hidden
    activations (each block's output, the residual stream) of mup vary by at most 1.5x across the widths; under sp
    the branches (attention, feed-forward) and the residual stream grow with the width."""
    widths = [32, 64, 128, 256]
    mup = coord_check.sweep("mup", widths, [2], 4, 1e-2, optim)
    sp = coord_check.sweep("sp", widths, [2], 4, 1e-2, optim)
    assert coord_check.spread(mup, "block", 4) <= 1.5, [r[3]["block"] for r in mup.values()]
    assert max(coord_check.growth(sp, k, 4) for k in ("attention", "feed_forward", "block")) >= 4.0
    assert coord_check.growth(sp, "block", 4) >= 2.0
    assert coord_check.spread(mup, "embedding", 4) <= 1.1 and coord_check.spread(sp, "embedding", 4) <= 1.1


LEGACY = os.path.join(ROOT, "tests", "data", "legacy_sp_run")
LEGACY_FLAGS = ["--config", "configs/debug.toml", "--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                "--model.n_kv_heads", "1", "--model.ffn_dim", "64", "--model.vocab_size", "512",
                "--data.tokenizer_vocab_size", "512", "--data.max_documents", "40", "--data.seq_len", "32",
                "--train.global_batch_size", "4", "--train.steps", "6", "--checkpoint.interval", "3",
                "--train.val_interval", "0", "--optim.warmup_steps", "2"]
"""The flags of tests/data/legacy_sp_run: its step-3 checkpoint and its data, written by the code before
model.parametrization existed (tests/data/legacy_sp_losses.json: that code's losses of steps 1..6)."""


@pytest.mark.slow
def test_a_checkpoint_from_before_parametrizations_resumes_as_sp_with_the_old_codes_losses(tmp_path, monkeypatch, capsys):
    rd = tmp_path / "legacy"
    shutil.copytree(LEGACY, rd)
    for f in ("config.toml", "checkpoints/step_00000003/config.toml", "data/meta.json"):  # the run moved here
        path = rd / f
        path.write_text(path.read_text().replace("/tmp/legacy_run", str(rd)))
    with open(os.path.join(ROOT, "tests", "data", "legacy_sp_losses.json")) as f:
        old = {int(k): v for k, v in json.load(f)["losses"].items()}
    # A resume under mup of that sp checkpoint (its config.toml has no parametrization) is refused, naming both.
    def snapshot():
        return sorted((p, p.stat().st_mtime_ns) for p in rd.rglob("*") if p.name != ".lock")

    before = snapshot()
    rc, err = main_in_process(monkeypatch, capsys, "--run_dir", rd, *LEGACY_FLAGS, "--model.parametrization", "mup",
                              "--model.base_dim", "16")
    assert rc != 0 and "model.parametrization: checkpoint 'sp', now 'mup'; model.base_dim: checkpoint 0, " \
        "now 16" in err, err[-2000:]
    assert snapshot() == before
    train_in_process(monkeypatch, capsys, "--run_dir", rd, *LEGACY_FLAGS)  # 1 rank, in this process
    new = losses(rd)
    assert sorted(new) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # bit for bit: the same machine's kernels on the same weights
        assert new[step] == pytest.approx(old[step], rel=1e-6, abs=0), step


def test_a_mup_checkpoint_from_before_the_base_multipliers_resumes_only_with_its_own_attention_scale():
    """A mup run's config.toml from before the base multipliers lacks them, and its code scored q.k / head_dim. A
    resume with today's defaults would change the scores: it is refused, naming model.mup_attn_mult and the
    checkpoint's value; that value passed as printed is accepted and gives the old code's query factor,
    1 / sqrt(head_dim) (its scores q.k / head_dim), bit for bit. resume_point takes these two steps (predated,
    check_same_config) before any collective; test_a_checkpoint_from_before_parametrizations... runs it whole."""
    import dataclasses
    import re

    from checkpoint import CheckpointError
    from config import parse_config
    from nn import parametrization
    from training.resume import check_same_config

    argv = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--run_dir", "unused",
            "--model.parametrization", "mup", "--model.base_dim", "64"]
    cfg = parse_config(argv)
    new_fields = ("base_head_dim", *parametrization.MULTS)
    old_model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in new_fields}
    saved = {"model": {**parametrization.predated(old_model), **old_model}}
    with pytest.raises(CheckpointError) as e:
        check_same_config("ckpt", saved, "model", dataclasses.asdict(cfg.model))
    printed = re.search(r"model\.mup_attn_mult: checkpoint (\S+), now 1\.0\)", str(e.value))
    assert printed and "use the settings it was trained with" in str(e.value), str(e.value)
    again = parse_config([*argv, "--model.mup_attn_mult", printed.group(1)])
    check_same_config("ckpt", saved, "model", dataclasses.asdict(again.model))
    assert parametrization.multipliers(again.model).query == 1.0 / math.sqrt(cfg.model.head_dim)
