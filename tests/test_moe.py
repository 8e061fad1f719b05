"""Mixture of experts (nn/moe.py): the layer against a per-token reference, the dense model unchanged (against the pre-MoE code),
both balancing methods against a skewed router, Muon per expert, active parameters, 1 rank vs FSDP 2, and the
combinations that are refused until they are built."""
import os
import re
import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import hf
import train_2d
import train_fsdp
from launch import (
    DEBUG,
    REFERENCE_BATCH,
    before_any_collective,
    debug_run_in_process,
    losses,
    main_in_process,
    metrics,
    prepared_data_dir,
    refused,
    start,
    train_in_process,
    wait_for_step,
    wait_until_unlocked,
)
from model import ModelArgs, Transformer, flops_per_token, num_params
from nn import grouped_mm
from nn.moe import MoE
from optimization.muon import MuonAdamW
from parallel import distributed
from parallel.hooks import MoEHook, aux_of
from test_muon import newton_schulz_reference
from test_parametrization import LEGACY, LEGACY_FLAGS

TINY = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=48, max_seq_len=16)
MOE = ["--model.n_experts", "4", "--model.experts_per_token", "2"]


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer written out token by token: scores, top-k of scores + bias, each chosen expert's SwiGLU weighted."""
    rows = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = moe.router.weight @ t
        scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        chosen = sorted(range(moe.n_experts), key=lambda e: -(scores[e] + moe.expert_bias[e]).item())[:moe.top_k]
        weights = [scores[e] for e in chosen]
        total = sum(weights)
        out = torch.zeros_like(t)
        for e, w in zip(chosen, weights):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            out = out + (w / total if moe.renormalize else w) * (w2 @ (F.silu(w1 @ t) * (w3 @ t)))
        if moe.shared_experts is not None:
            s = moe.shared_experts
            out = out + s.w2.weight @ (F.silu(s.w1.weight @ t) * (s.w3.weight @ t))
        rows.append(out)
    return torch.stack(rows).view_as(x)


def tiny_moe(score="softmax", shared=0, renormalize=True, seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(8, 4, 2, 6, shared, score, renormalize, **kw).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))  # the bias steers the choice, never the weights
    return moe


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_matches_the_per_token_reference(score, shared, renormalize):
    moe = tiny_moe(score, shared, renormalize)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    got = moe(x)
    want = reference_moe(moe, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert moe.counts.sum().item() == 10 * 2
    g = torch.randn_like(got)
    params = [x, *moe.parameters()]
    grads = torch.autograd.grad((got * g).sum(), params)
    want_grads = torch.autograd.grad((want * g).sum(), params)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_every_expert_path_computes_the_same_when_some_experts_get_no_token():
    moe = tiny_moe()
    moe.expert_bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))  # experts 2 and 3 idle
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-6)
    assert moe.counts.tolist() == [3, 3, 0, 0]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("idle", [False, True])
def test_moe_in_fp32_on_cpu_runs_the_grouped_kernel_and_matches_the_per_token_reference(idle):
    torch.manual_seed(0)
    moe = MoE(8, 4, 2, 8, 1, "sigmoid")  # expert_ffn_dim 8: rows of 32 bytes, which the kernel takes
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.expert_bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0] if idle else [0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(2, 5, 8, requires_grad=True)
    with mock.patch.object(grouped_mm, "grouped_mm_kernel", wraps=grouped_mm.grouped_mm_kernel) as kernel:
        got = moe(x)
        params = [x, *moe.parameters()]
        grads = torch.autograd.grad(got.sum(), params)  # .sum(): a zero-stride gradient arrives
    assert kernel.call_count == 3  # w1, w3, w2
    assert (moe.counts[2:] == 0).all() == idle
    want = reference_moe(moe, x)
    want_grads = torch.autograd.grad(want.sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_n_experts_0_builds_and_computes_the_dense_model_from_before_moe():
    # The reference is this seed-fixed build under the code before MoE existed (commit 631cb78), in fp64: its
    # weights and its forward (logits returned in fp32). Digests would pin the CPU instead: the last bits of the
    # init and of the forward differ between ATen's kernels (AVX2, AVX-512, none), while the old and the new code
    # agree bitwise on each. Bitwise on one machine: accept.py moe, the default against n_experts 0.
    m = Transformer(ModelArgs(**TINY))
    m.init_weights(seed=7)
    w = torch.cat([v.double().flatten() for v in m.state_dict().values()])
    tokens = torch.arange(16).view(2, 8) * 3 % 64
    out = m.double()(tokens).detach().double()

    def close(got: list[float], want: list[float], rtol: float) -> None:
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=rtol, atol=rtol / 10)
    assert len(m.state_dict()) == 21
    close([w.sum().item(), w.square().sum().item(), *w[::997][:4].tolist()],
          [158.44564493025132, 166.28834463048884, -0.019215216860175133, -0.005593602545559406,
           -0.008878061547875404, 0.03226475790143013], rtol=1e-6)
    close([out.sum().item(), out.square().sum().item(), *out[0, 0, :3].tolist(), *out[1, 7, -3:].tolist()],
          [-3.0362648963928223, 13.237852096557617, -0.08745789527893066, 0.02888140082359314,
           0.09675490856170654, -0.1655822992324829, -0.023116711527109146, 0.029315399006009102], rtol=1e-5)


def test_moe_init_covers_parameters_and_bias_deterministically():
    args = ModelArgs(**TINY, n_experts=4, experts_per_token=2, n_shared_experts=1, moe_first_dense=1)
    a = Transformer(args)
    a.init_weights(seed=3)
    with torch.device("meta"):
        b = Transformer(args)
    b.to_empty(device="cpu")
    b.init_weights(seed=3)
    assert a.state_dict().keys() == b.state_dict().keys()
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert "layers.0.feed_forward.w1.weight" in a.state_dict()  # moe_first_dense 1
    assert a.layers[1].feed_forward.experts.w1.shape == (4, 48, 32)
    assert a.layers[1].feed_forward.experts.w1.std().item() == pytest.approx(0.02, rel=0.1)
    assert a.layers[1].feed_forward.experts.w2.std().item() == pytest.approx(0.02 / 2, rel=0.1)  # 1/sqrt(2 L)
    assert torch.equal(a.layers[1].feed_forward.expert_bias, torch.zeros(4))


def test_active_parameters_and_flops_count_the_routed_experts_a_token_uses():
    args = ModelArgs(**TINY, n_experts=4, experts_per_token=2, expert_ffn_dim=24, n_shared_experts=1,
                     moe_first_dense=1)
    model = Transformer(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    idle = 2 * 3 * 32 * 24  # 2 of 4 routed experts, one MoE layer
    assert num_params(args, active=True) == num_params(args) - idle
    dense = ModelArgs(**TINY)
    assert flops_per_token(args, 16) - flops_per_token(dense, 16) == 6 * (
        num_params(args, active=True) - num_params(dense))


def _skewed_layer(**kw) -> tuple[MoE, torch.Tensor]:
    """A layer whose router sends most tokens of x to expert 0 (x shares one direction the router favours)."""
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 8, **kw)
    direction = torch.randn(16)
    x = torch.randn(4, 64, 16) * 0.5 + direction
    with torch.no_grad():
        moe.router.weight.normal_(std=0.1)
        moe.router.weight[0] += direction * 0.5
    return moe, x


def _max_load(counts: torch.Tensor) -> float:
    return (counts.max() / counts.float().mean()).item()


@pytest.mark.parametrize("rate", [0.0, 0.003])
def test_the_bias_update_evens_out_a_skewed_router(rate):
    moe, x = _skewed_layer(score="sigmoid")
    model = torch.nn.Sequential(moe)
    with torch.no_grad():
        model(x)
        start = _max_load(moe.counts)
        hook = MoEHook(model, None, "cpu", moe.n_experts, False, rate)  # the step's own bias update, one process
        for _ in range(200):
            hook.begin()
            model(x)
            aux_of([hook], model)
            hook.after_update(True)
    assert start > 2.5
    if rate:
        assert _max_load(moe.counts) < 1.3
    else:
        assert _max_load(moe.counts) == start


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_the_aux_loss_evens_out_a_skewed_router(coef):
    moe, x = _skewed_layer(aux_coef=coef, z_coef=1e-3)
    opt = torch.optim.Adam(moe.router.parameters(), lr=1e-2)
    moe(x)
    start = _max_load(moe.counts)
    for _ in range(100):
        moe(x)
        opt.zero_grad()
        (moe.aux_loss / x.shape[:2].numel()).backward()
        opt.step()
    moe(x)
    assert start > 2.5
    assert (_max_load(moe.counts) < 1.3) == bool(coef), _max_load(moe.counts)


def test_the_aux_loss_is_the_per_sequence_balance_loss_summed_over_tokens():
    moe = tiny_moe(aux_coef=1.0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    moe(x)
    want = 0.0
    for seq in x:  # Switch's f_i P_i per sequence (DeepSeek-V3's sequence-wise form), times its 5 tokens
        probs = (seq @ moe.router.weight.T).softmax(-1)
        top = (probs + moe.expert_bias).topk(2).indices
        f = torch.zeros(4, dtype=torch.float64).index_add_(0, top.flatten(), torch.ones(10, dtype=torch.float64))
        want += 5 * ((4 / (2 * 5)) * f * probs.mean(0)).sum().item()
    assert moe.aux_loss.item() == pytest.approx(want, rel=1e-9)


def test_muon_orthogonalises_each_expert_on_its_own():
    torch.manual_seed(0)
    w = torch.randn(3, 6, 4)
    grads = [torch.randn(3, 6, 4) for _ in range(2)]
    p = torch.nn.Parameter(w.clone())
    opt = MuonAdamW([{"params": [p], "muon": True, "weight_decay": 0.1}], lr=0.02)
    refs = [torch.nn.Parameter(w[e].clone()) for e in range(3)]
    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz",
                           lambda g, c, s, eps: newton_schulz_reference(g, torch.float32, c, s, eps)):
        ref_opt = torch.optim.Muon(refs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        for g in grads:
            p.grad = g.clone()
            opt.step()
            for e, r in enumerate(refs):
                r.grad = g[e].clone()
            ref_opt.step()
    torch.testing.assert_close(p.detach(), torch.stack([r.detach() for r in refs]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- refusals, before any collective

TOP_1 = ["--model.experts_per_token", "1", "--model.moe_renormalize", "false"]
"""Top-1 routing that trains its router (test_top_1_routing_with_renormalised_weights_is_refused...)."""
TOP_1_REFUSAL = ("error: model.experts_per_token 1 with model.moe_renormalize true weights each token's one expert by 1 "
                 "whatever the router scores, so the router gets no gradient and never learns; pass "
                 "--model.moe_renormalize false")

@pytest.mark.parametrize("argv, msg", [
    (["--model.experts_per_token", "2"], "model.experts_per_token applies only to a mixture of experts"),
    (["--model.moe_score", "softmax", "--model.moe_aux_loss", "0.01"],
     "model.moe_score, model.moe_aux_loss apply only to a mixture of experts"),
    (["--model.n_experts", "4", "--model.experts_per_token", "5"],
     "model.experts_per_token must be in 1..model.n_experts (4), got 5"),
    (["--model.n_experts", "4"], "model.experts_per_token must be in 1..model.n_experts (4), got 0"),
    ([*MOE, "--model.expert_ffn_dim", "-1"], "model.expert_ffn_dim must be >= 0 (0: model.ffn_dim), got -1"),
    ([*MOE, "--model.moe_score", "relu"], "model.moe_score must be one of softmax, sigmoid, got 'relu'"),
    ([*MOE, "--model.moe_first_dense", "4"], "model.moe_first_dense must be in 0..model.n_layers-1 (3), got 4"),
    (["--parallel.ep", "2"], "parallel.ep 2 splits the experts of a mixture of experts, and model.n_experts is 0 "
                             "(dense); set --model.n_experts (a multiple of 2) or use parallel.ep 1"),
    (["--model.n_experts", "4", "--model.experts_per_token", "1"], TOP_1_REFUSAL),
    (["--model.n_experts", "3", *TOP_1, "--parallel.ep", "2"],
     "parallel.ep (2) does not divide model.n_experts (3): each EP rank holds whole experts, as many as the others; "
     "use parallel.ep in [1]"),  # 3 divides the experts but not the 2 ranks
    ([*MOE, "--parallel.ep", "4"], "parallel.ep (4) does not divide the 2 data-parallel shard rank(s) (world size 2 "
                                   "/ (dp_replicate 1 x cp 1 x tp 1)) that expert parallelism splits; use parallel.ep "
                                   "in [1, 2] or launch a multiple of 4 processes"),
    ([*MOE, "--parallel.ep", "4", "--parallel.cp", "2"], "parallel.ep (4) does not divide the 1 data-parallel shard "
                                                         "rank(s) (world size 2 / (dp_replicate 1 x cp 2 x tp 1)) that "
                                                         "expert parallelism splits, nor is it parallel.cp (2) times "
                                                         "a divisor of them (EP then takes in those ranks); use "
                                                         "parallel.ep in [1, 2] or launch a multiple of 4 processes"),
    ([*MOE, "--parallel.ep", "0"], "parallel.ep must be >= 1, got 0"),
    ([*MOE, "--init_from_hf", "/nonexistent"], "--init_from_hf: '/nonexistent' is not a directory"),
])
def test_bad_moe_settings_are_refused_in_one_line(tmp_path, monkeypatch, capsys, argv, msg):
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *argv], capsys)
    assert msg in line, line
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("world, argv", [
    (2, ["--model.n_experts", "3", *TOP_1, "--parallel.ep", "2"]),
    (4, ["--model.n_experts", "6", *TOP_1, "--parallel.ep", "4"]),
    (2, [*MOE, "--parallel.ep", "4"]),
])
def test_every_expert_parallel_size_offered_is_accepted_as_printed(tmp_path, monkeypatch, capsys, world, argv):
    base = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *argv]
    with before_any_collective(monkeypatch, world):
        line = refused(train_fsdp.main, base, capsys)
        offered = re.search(r"use parallel\.ep in \[([\d, ]+)\]", line).group(1).split(", ")
        for ep in offered:
            with pytest.raises(AssertionError, match="a collective started"):  # every check passed
                train_fsdp.main([*base, "--parallel.ep", ep])


def test_moe_option_remedies_are_accepted_as_printed(tmp_path, monkeypatch):
    from config import parse_config
    from core.errors import ConfigError, SetupError
    from training.command import check_run

    with pytest.raises(ConfigError, match="set --model.n_experts .and --model.experts_per_token., or drop them"):
        parse_config(["--config", DEBUG, "--model.n_shared_experts", "1"])
    assert parse_config(["--config", DEBUG, "--model.n_shared_experts", "1", *MOE]).model.n_shared_experts == 1
    assert parse_config(["--config", DEBUG]).model.n_experts == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_run(parse_config(["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *MOE]), 1)
    # parallel.ep of a dense model: either printed way passes every check at 2 ranks.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    base = ["--config", DEBUG, "--run_dir", str(tmp_path / "ep"), "--parallel.ep", "2"]
    with pytest.raises(SetupError, match=r"set --model.n_experts \(a multiple of 2\) or use parallel.ep 1"):
        check_run(parse_config(base), 2)
    check_run(parse_config([*base, "--model.n_experts", "2", *TOP_1]), 2)
    check_run(parse_config([*base, "--parallel.ep", "1"]), 2)


def router_share(renormalize: bool) -> float:
    """|router gradient| / |experts' gradient| of a top-1 MoE under a loss of its output (the router's only
    gradient: no balance or z-loss), as a fraction: how much the language-model loss trains the router."""
    moe = tiny_moe("softmax", renormalize=renormalize)
    moe.top_k = 1
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (moe(x) * torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))).sum().backward()
    experts = torch.cat([p.grad.flatten() for p in moe.experts.parameters()])
    return (moe.router.weight.grad.norm() / experts.norm()).item()


def test_top_1_routing_with_renormalised_weights_is_refused_and_the_printed_fix_trains_the_router(tmp_path, monkeypatch,
                                                                                                 capsys):
    """Top-1 with renormalised weights: each token's weight is s / s = 1, so the router gets no gradient from the
    loss (the run's router moved 1e-6 where the other matrices moved 1e-3). Refused before any collective; the
    printed fix (raw weights, Switch's top-1) gives the router a gradient of the experts' order, and passes."""
    assert router_share(renormalize=True) < 1e-12  # the reason: nothing but rounding reaches the router
    assert router_share(renormalize=False) > 1e-2  # the fix: the router learns with the experts
    base = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), "--model.n_experts", "4",
            "--model.experts_per_token", "1"]
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, base, capsys)
        assert line.startswith(TOP_1_REFUSAL), line
        with pytest.raises(AssertionError, match="a collective started"):  # every check passed
            train_fsdp.main([*base, "--model.moe_renormalize", "false"])
        with pytest.raises(AssertionError, match="a collective started"):  # top-2 renormalised: the router learns
            train_fsdp.main([*base[:-1], "2"])


SOFTMAX = [*MOE, "--model.moe_score", "softmax"]
SOFTMAX_NOTICE = ("[train] notice: hf.py export will refuse this model: a MixtralForCausalLM (softmax routing) has no "
                  "routing bias, and the balancing bias (model.moe_bias_update_rate 0.01) moves from the first step; "
                  "to keep the run exportable, pass --model.moe_bias_update_rate 0")
"""Softmax routing with the default balancing bias, and the start's notice for it: hf.py export refuses the run once
the bias moved (Mixtral has no routing bias), hours later."""


def test_the_export_notice_names_the_refusal_and_its_printed_fix_keeps_the_model_exportable():
    """The notice for softmax with the default bias; the printed flag gives a model the export takes, and no notice.
    An exportable MoE (sigmoid, the default) and a dense model get none."""
    import hf_format
    from config import parse_config
    from training.loop import export_notice

    def model(*flags):
        return parse_config(["--config", DEBUG, *flags]).model

    assert export_notice(model(*SOFTMAX)).startswith(SOFTMAX_NOTICE)
    fixed = model(*SOFTMAX, "--model.moe_bias_update_rate", "0")  # the printed fix
    assert export_notice(fixed) == "" and hf_format.hf_model_type(fixed) == "mixtral"
    assert export_notice(model(*MOE)) == export_notice(model()) == ""  # sigmoid (a Glm4MoeForCausalLM); dense
    # Shape and bias refused both: one line names both, so that one fix is not followed by a second refusal.
    both = export_notice(model(*SOFTMAX, "--model.n_shared_experts", "1"))
    assert "cannot express model.n_shared_experts 1" in both and "pass --model.moe_bias_update_rate 0" in both, both


@pytest.mark.slow
def test_the_start_of_a_softmax_run_with_the_default_bias_says_the_export_will_refuse_it(tmp_path, monkeypatch, capsys):
    """The notice reaches the console at the start, under the start line, before the first step."""
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    capsys.readouterr()
    assert train_fsdp.main(["--config", DEBUG, "--run_dir", str(rd), *SOFTMAX, "--model.n_layers", "1",
                            "--train.steps", "1", "--train.val_interval", "0", "--checkpoint.interval", "1000"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = [i for i, line in enumerate(out) if line.startswith(SOFTMAX_NOTICE)]
    start = next(i for i, line in enumerate(out) if line.startswith("[train] mesh"))
    first_step = next(i for i, line in enumerate(out) if line.startswith("step 1/1"))
    assert len(at) == 1 and start < at[0] < first_step, out


def test_expert_parallelism_with_selective_checkpointing_and_compile_together_is_refused(tmp_path, monkeypatch, capsys):
    """The one activation-checkpointing combination under EP that does not run (its replay fails at the first
    backward): refused before any collective, and either printed way passes every check."""
    base = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *MOE, *EP2, "--train.activation_checkpointing",
            "selective", "--train.compile", "true"]
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, base, capsys)
        assert line == ("error: parallel.ep 2 does not run with train.activation_checkpointing selective and "
                        "train.compile true together yet (docs/moe.md); use train.activation_checkpointing full, or "
                        "train.compile false"), line
        for fix in (["--train.activation_checkpointing", "full"], ["--train.compile", "false"]):
            with pytest.raises(AssertionError, match="a collective started"):
                train_fsdp.main([*base, *fix])


def test_an_ep_that_neither_the_data_parallel_nor_the_tp_ranks_fit_is_refused_before_any_collective(
        tmp_path, monkeypatch, capsys):
    """EP with TP runs over the data-parallel ranks (MOE_LAYOUTS' ep2-tp2) or, where those are too few, over them and
    the TP ranks (tp2-ep2); at tp 2 on 2 ranks an ep of 4 fits neither, and the size check says so."""
    with before_any_collective(monkeypatch, 2):
        line = refused(train_2d.main, ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), "--parallel.tp", "2",
                                       "--parallel.ep", "4", *MOE], capsys)
    assert "parallel.ep (4) does not divide the 1 data-parallel shard rank(s) (world size 2 / (dp_replicate 1 x cp 1 " \
        "x tp 2)) that expert parallelism splits, nor is it parallel.tp (2) times a divisor of them (EP then takes " \
        "in those ranks); use parallel.ep in [1, 2] or launch a multiple of 4 processes" in line, line


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A finished 2-step MoE run (1 rank) with its checkpoint."""
    rd = tmp_path_factory.mktemp("moe")
    prepared_data_dir(rd)
    with pytest.MonkeyPatch.context() as mp:  # in this process
        debug_run_in_process(mp, None, rd, "--train.steps", "2", "--checkpoint.interval", "2", "--train.val_interval",
                             "0", *MOE, "--model.n_shared_experts", "1")
    return rd


def _snapshot(rd):
    return sorted((str(p), p.stat().st_mtime_ns) for p in rd.rglob("*") if p.name != ".lock")


@pytest.mark.slow
def test_moe_train_records_carry_the_load_and_the_bias_range(moe_run):
    recs = [r for r in metrics(moe_run) if "loss" in r]
    assert len(recs) == 2 and all(r["moe_max_load"] >= 1 and r["moe_bias_range"] >= 0 for r in recs)


@pytest.mark.slow
def test_moe_checkpoint_resumed_as_dense_and_the_reverse_are_refused(moe_run, tmp_path, monkeypatch, capsys):
    # MoE saved, resumed dense: refused naming both; the printed flags resume it.
    before = _snapshot(moe_run)
    rc, stderr = main_in_process(monkeypatch, capsys, "--config", DEBUG, "--run_dir", moe_run, "--train.steps", "3",
                                 "--train.val_interval", "0")
    err = next((line for line in stderr.splitlines() if line.startswith("error: ")), stderr[-2000:])
    assert rc != 0 and "holds a mixture of experts (model.n_experts 4), but this run is a dense model " \
        "(model.n_experts 0); pass --model.n_experts 4 --model.experts_per_token 2 --model.n_shared_experts 1 to " \
        "resume it" in err, stderr[-2000:]
    assert _snapshot(moe_run) == before
    flags = err.split("; pass ")[1].split(" to resume it")[0].split()
    debug_run_in_process(monkeypatch, capsys, moe_run, "--train.steps", "3", "--train.val_interval", "0", *flags)
    assert [r["step"] for r in metrics(moe_run) if "loss" in r] == [1, 2, 3]
    # A dense checkpoint written before MoE existed, resumed as an MoE: refused naming both (it resumes dense:
    # test_parametrization.py's legacy test).
    rd = tmp_path / "legacy"
    shutil.copytree(LEGACY, rd)
    for f in ("config.toml", "checkpoints/step_00000003/config.toml", "data/meta.json"):  # the run moved here
        (rd / f).write_text((rd / f).read_text().replace("/tmp/legacy_run", str(rd)))
    before = _snapshot(rd)
    rc, stderr = main_in_process(monkeypatch, capsys, "--run_dir", rd, *LEGACY_FLAGS, *MOE)
    assert rc != 0 and "holds a dense model (model.n_experts 0), but this run is a mixture of experts " \
        "(model.n_experts 4); resume it without --model.n_experts" in stderr, stderr[-2000:]
    assert _snapshot(rd) == before


@pytest.mark.slow
def test_hf_export_of_an_moe_run_computes_our_logits_in_transformers(moe_run, tmp_path):
    """The default MoE (sigmoid scores, the balancing bias moved by 2 steps, a shared expert) exports as
    Glm4MoeForCausalLM, whose logits are ours (tests/test_hf.py tests each class and the import)."""
    import transformers

    import generate

    assert hf.main(["export", "--run_dir", str(moe_run), "--out", str(tmp_path / "out")]) == 0
    ours, _ = generate.load_model(str(moe_run))
    assert any(bool(b.any()) for n, b in ours.named_buffers() if n.endswith("expert_bias"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(ref).__name__ == "Glm4MoeForCausalLM"
    tokens = torch.randint(0, ours.args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens) - ref(tokens).logits).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- layouts

MUON = ["--optim.name", "muon"]
MOE_LOSSES = [*MOE, "--model.expert_ffn_dim", "96", "--model.n_shared_experts", "1", "--model.moe_aux_loss", "0.01",
              "--model.moe_router_z_loss", "0.001", "--model.moe_bias_update_rate", "0.01", "--data.seq_len", "128"]
"""The layouts' MoE, on the debug config's windows of 128 tokens: at the `worker`'s 64, cp 2 x ep 2's output.weight
gradient left the bounds below while its losses and norms stayed within 1e-5, as a routing near-tie leaves them
(docs/moe.md)."""


EP2 = ["--parallel.ep", "2"]
MOE_LAYOUTS = {
    "fsdp2": (2, 1, [], []),
    "ep2": (2, 1, [], EP2),
    "ep2-ac-full": (2, 1, [], [*EP2, "--train.activation_checkpointing", "full"]),
    "ep2-ac-selective": (2, 1, [], [*EP2, "--train.activation_checkpointing", "selective"]),
    "fsdp4-ep2-muon": (4, 1, MUON, [*MUON, *EP2]),
    "hsdp2-ep2": (4, 1, [], [*EP2, "--parallel.dp_replicate", "2"]),
    "ep2-tp2": (4, 2, [], EP2),
    "ep2-cp2": (4, 1, [], [*EP2, "--parallel.cp", "2"]),
    "cp2-ep2": (2, 1, [], [*EP2, "--parallel.cp", "2"]),
    "tp2-ep2": (2, 2, [], EP2),
}
"""id: (ranks, tp, 1-rank flags, the layout's flags) beside MOE_LAYOUTS: FSDP 2; expert parallelism over 2 ranks,
with each activation checkpointing (none, full, selective: the experts' own fully_shard group runs its hooks inside
the recomputed block); experts both split over EP and FSDP-sharded (4 ranks: 2 hold each expert), under Muon; HSDP
with EP inside a replica; EP with TP (train_2d.py's plan; the router and experts replicated over TP, their gradients
summed over it) and with CP (each EP rank sends its own share of the sequence, parallel/moe_sequence.py); EP over the
CP ranks and over the TP ranks (2 ranks: one data-parallel rank, too few for EP, which takes in the others).
Left out for the suite's time, as their paths run here in a layout with EP: FSDP 2 with full recompute (ep2-ac-full),
dp 1 x tp 2 (ep2-tp2), cp 2 (ep2-cp2), Muon at FSDP 2 (fsdp4-ep2-muon); accept.py moe runs dp 1 x tp 2 and cp 2.
CP with TP (the balance loss summed over both groups) is left to a manual run: 4 ranks, --parallel.cp 2
--parallel.tp 2 --model.n_kv_heads 4, equal to one process to 1.2e-7 (issue 54's note)."""


@pytest.mark.slow
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_losses_and_gradients_equal_one_process_at_every_layout(worker, layout):
    worker.prefetch([(1, 1, *MOE_LOSSES, *one) for _, _, one, _ in MOE_LAYOUTS.values()]
                    + [(n, tp, *MOE_LOSSES, *flags) for n, tp, _, flags in MOE_LAYOUTS.values()])
    n, tp, one_flags, flags = MOE_LAYOUTS[layout]
    one, other = worker(1, 1, *MOE_LOSSES, *one_flags), worker(n, tp, *MOE_LOSSES, *flags)
    assert one["losses"] == pytest.approx(other["losses"], rel=1e-5, abs=0)
    assert one["grad_norms"] == pytest.approx(other["grad_norms"], rel=1e-5, abs=0)
    for g1, g2 in zip(one["grads"], other["grads"]):
        assert g1.keys() == g2.keys()
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(one["moe"], other["moe"]):
        assert a.keys() == b.keys() == {"moe_max_load", "moe_bias_range", "moe_aux_loss"}
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-9), k
    assert one["moe"][-1]["moe_bias_range"] > 0  # the bias moved, from the global counts
    assert all(spread == 0 for spread in other["replicated"].values()), other["replicated"]


@pytest.mark.slow
def test_sigkill_at_ep_2_then_resume_on_1_rank_gives_the_uninterrupted_losses(tmp_path, monkeypatch, capsys):
    args = ["--config", DEBUG, "--train.steps", "6", "--checkpoint.interval", "2", "--train.val_interval", "0",
            *REFERENCE_BATCH, *MOE_LOSSES]
    ref, rd = tmp_path / "ref", tmp_path / "killed"
    for d in (ref, rd):
        prepared_data_dir(d)
    train_in_process(monkeypatch, capsys, *args, "--run_dir", ref)  # the 1-rank runs: in this process
    p = start(2, "train_fsdp.py", *args, "--run_dir", str(rd), *EP2, log_path=tmp_path / "killed.log")
    wait_for_step(rd, 3, p)
    p.kill()
    assert p.wait(timeout=120) != 0, "the run finished before it was killed"
    wait_until_unlocked(rd)  # its workers are gone: the resume starts at once, in this process
    train_in_process(monkeypatch, capsys, *args, "--run_dir", rd)  # the experts of 2 ranks, whole on 1
    want, got = losses(ref), losses(rd)
    assert sorted(got) == list(range(1, 7))
    assert max(abs(got[s] - want[s]) / want[s] for s in want) <= 1e-5
