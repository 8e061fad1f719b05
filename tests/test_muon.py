"""Muon (muon.py) against torch.optim.Muon + torch.optim.AdamW on one process, at every parallel layout.

The reference: torch's own optimizers on full tensors, Muon with adjust_lr_fn="match_rms_adamw"
on the blocks' hidden matrices and AdamW on the rest, from the same initial weights and the
same gradients (tests/muon_worker.py); 2 steps, so the momentum buffer is exercised. On a CPU
MuonAdamW runs Newton-Schulz in fp32, so the reference runs torch.optim.Muon with torch's
iteration in fp32 (newton_schulz_reference below).
"""
import json
from unittest import mock

import pytest
import torch
import torch.optim._muon

from config import parse_config
from launch import DEBUG, REFERENCE_BATCH, losses, prepared_data_dir, run, train_in_process
from model import Transformer
from nn.roles import roles
from optimization import muon
from optimization.muon import is_muon_matrix
from optimization.optimizers import lr_factor
from ranks import run_ranks

RTOL = 1e-5
KELLER_JORDAN = (3.4445, -4.7750, 2.0315)
"""The quintic's coefficients, from https://github.com/KellerJordan/Muon (torch's DEFAULT_A, B, C)."""


def newton_schulz_reference(g: torch.Tensor, dtype: torch.dtype, coefficients=KELLER_JORDAN, steps: int = 5,
                            eps: float = 1e-7) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz written out, in `dtype` instead of bf16 (torch 2.13's source)."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype, copy=True)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


SHAPES = [(128, 128), (64, 128), (384, 128), (128, 384), (768, 256), (3, 5)]


def test_the_fp32_newton_schulz_is_torchs_iteration_in_fp32():
    assert (torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C) == KELLER_JORDAN
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        g = torch.randn(shape, generator=gen)
        before = g.clone()
        # The written-out reference is torch's function: in bf16 it gives torch's bits.
        assert torch.equal(newton_schulz_reference(g, torch.bfloat16),
                           torch.optim._muon._zeropower_via_newtonschulz(g, KELLER_JORDAN, 5, 1e-7)), shape
        got = muon.newton_schulz_fp32(g, KELLER_JORDAN, 5, 1e-7)
        assert got.dtype == torch.float32 and got.shape == shape and torch.equal(g, before)
        exact = newton_schulz_reference(g, torch.float64)
        # fp32 rounding leaves ~3e-6 of the largest entry; bf16's leaves ~2e-2.
        assert (got.double() - exact).abs().max() <= 2e-5 * exact.abs().max(), shape
        torch.testing.assert_close(got, newton_schulz_reference(g, torch.float32))


@pytest.mark.parametrize("native_bf16", [False, True], ids=["no_bf16_units", "bf16_units"])
def test_muon_adamw_on_a_cpu_runs_newton_schulz_in_fp32(monkeypatch, native_bf16):
    # The rule is the device type: fp32 on every CPU, with or without bf16 units; torch's bf16 on a GPU.
    monkeypatch.setattr("parallel.distributed.cpu_has_native_bf16", lambda: native_bf16)
    assert muon.newton_schulz_for(torch.device("cpu")) is muon.newton_schulz_fp32
    assert muon.newton_schulz_for(torch.device("cuda", 0)) is torch.optim._muon._zeropower_via_newtonschulz
    gen = torch.Generator().manual_seed(0)
    # float64 weights, so that the update is all the difference holds (fp32 weights would round it).
    w0, grad = (torch.randn(384, 128, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.nn.Parameter(w0.clone())
    w.grad = grad.clone()
    lr, mu = 0.01, 0.95
    muon.MuonAdamW([{"params": [w], "muon": True}], lr=lr, momentum=mu).step()
    # torch.optim.Muon's first step by hand: buffer (1 - mu) g, Nesterov update g + mu (buf - g), scaled LR.
    update = grad.lerp((1 - mu) * grad, mu)
    want = -lr * 0.2 * 384 ** 0.5 * newton_schulz_reference(update, torch.float64)
    assert (w.detach() - w0 - want).abs().max() <= 2e-5 * want.abs().max()  # bf16's iteration misses by ~2e-2


def reference(result: dict) -> dict:
    """The parameters after the worker's steps, from torch.optim.Muon and torch.optim.AdamW on full tensors.

    torch.optim.Muon runs with newton_schulz_reference in fp32 in place of its bf16 iteration,
    as MuonAdamW does on a CPU (the worker's device).
    """
    with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz",
                           lambda g, coefficients, steps, eps: newton_schulz_reference(g, torch.float32, coefficients,
                                                                                        steps, eps)):
        return _reference(result)


def debug_roles() -> dict:
    """The declared roles (nn/roles.py) of the debug config's model, by name."""
    with torch.device("meta"):
        return roles(Transformer(parse_config(["--config", DEBUG]).model))


def _reference(result: dict) -> dict:
    o = parse_config(["--config", DEBUG]).optim
    lr = o.lr * lr_factor(0, o.warmup_steps, 200, o.min_lr_ratio)  # the worker never steps the schedule
    params = {n: torch.nn.Parameter(t.clone()) for n, t in result["init"].items()}
    role = debug_roles()
    muon = [p for n, p in params.items() if is_muon_matrix(role[n])]
    decay = [p for n, p in params.items() if not is_muon_matrix(role[n]) and p.ndim >= 2]
    rest = [p for p in params.values() if p.ndim < 2]
    opts = [torch.optim.Muon(muon, lr=lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                             adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0}],
                              lr=lr, betas=(o.beta1, o.beta2), eps=o.eps)]
    for grads in result["grads"]:
        for n, p in params.items():
            p.grad = grads[n].clone()
        for opt in opts:
            opt.step()
    return {n: p.detach() for n, p in params.items()}


LAYOUTS = {"ws1": (1, 1, ()), "fsdp2": (2, 1, ()), "hsdp2x1": (2, 1, ("--parallel.dp_replicate", "2")),
           "dp1xtp2": (2, 2, ())}


@pytest.fixture(scope="module")
def muon_results(tmp_path_factory) -> dict:
    """{layout: tests/muon_worker.py's result}: the layouts of one world size in one launch, on the prepared corpus."""
    results = {}
    for nproc in sorted({n for n, _, _ in LAYOUTS.values()}):
        root = tmp_path_factory.mktemp(f"muon_{nproc}")
        jobs = {}
        for name, (n, tp, extra) in LAYOUTS.items():
            if n == nproc:
                prepared_data_dir(root / name)
                jobs[name] = ["--out", str(root / name / "muon.pt"), "--tp", str(tp), "--config", DEBUG,
                              "--run_dir", str(root / name), *extra]
        with open(root / "jobs.json", "w") as f:
            json.dump(list(jobs.values()), f)
        run_ranks(nproc, "muon_worker", "--jobs", str(root / "jobs.json"), timeout=300)
        results.update({name: torch.load(argv[1]) for name, argv in jobs.items()})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_distributed_muon_update_equals_torch_muon(muon_results, layout):
    result = muon_results[layout]
    want = reference(result)
    role = debug_roles()
    assert sum(is_muon_matrix(role[n]) for n in want) == 28  # 4 layers x 7 matrices
    for n, w in want.items():
        moved = (w - result["init"][n]).norm()
        err = (result["after"][n] - w).norm() / moved
        assert err <= RTOL, (n, err.item())


@pytest.mark.slow
def test_muon_wsd_checkpoint_loads_at_another_world_size(tmp_path, monkeypatch, capsys):
    """2 FSDP ranks for 10 steps, saved at step 5; a 1-rank run loaded from that step (its momentum buffers
    resharded by DCP, its WSD schedule recomputed) continues with the uninterrupted run's losses."""
    common = ["--config", DEBUG, "--optim.name", "muon", "--optim.schedule", "wsd", "--optim.decay_fraction", "0.5",
              "--optim.warmup_steps", "2", "--train.steps", "10", "--checkpoint.interval", "5",
              "--train.val_interval", "0", *REFERENCE_BATCH]
    ref, branch = tmp_path / "ref", tmp_path / "branch"
    for d in (ref, branch):
        prepared_data_dir(d)  # the session's tokenized corpus: no tokenizer training per run
    first = run(2, "train_fsdp.py", *common, "--run_dir", ref)
    assert "all_gather_into_tensor" not in first.stderr  # torch 2.13's FutureWarning, once per rank, is gone
    train_in_process(monkeypatch, capsys, *common, "--run_dir", branch, "--checkpoint.load_from",  # 1 rank, here
                     ref / "checkpoints" / "step_00000005")
    a, b = losses(ref), losses(branch)
    assert sorted(b) == list(range(6, 11))
    for step in b:
        assert abs(a[step] - b[step]) / a[step] <= 1e-4, step
