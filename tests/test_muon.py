"""Muon (muon.py) against torch.optim.Muon + torch.optim.AdamW on one process, at every parallel layout.

The reference: torch's own optimizers on full tensors, Muon with adjust_lr_fn="match_rms_adamw"
on the blocks' hidden matrices and AdamW on the rest, from the same initial weights and the
same gradients (tests/muon_worker.py); 2 steps, so the momentum buffer is exercised.
"""
import pytest
import torch

from config import parse_config
from launch import DEBUG, losses, torchrun
from optimization.muon import is_muon_matrix
from optimization.optimizers import lr_factor

RTOL = 1e-5


def reference(result: dict) -> dict:
    """The parameters after the worker's steps, from torch.optim.Muon and torch.optim.AdamW on full tensors."""
    o = parse_config(["--config", DEBUG]).optim
    lr = o.lr * lr_factor(0, o.warmup_steps, 200, o.min_lr_ratio)  # the worker never steps the schedule
    params = {n: torch.nn.Parameter(t.clone()) for n, t in result["init"].items()}
    muon = [p for n, p in params.items() if is_muon_matrix(n)]
    decay = [p for n, p in params.items() if not is_muon_matrix(n) and p.ndim >= 2]
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


@pytest.mark.slow
@pytest.mark.parametrize("nproc, tp, extra", [(1, 1, ()), (2, 1, ()), (2, 1, ("--parallel.dp_replicate", "2")),
                                              (2, 2, ())], ids=["ws1", "fsdp2", "hsdp2x1", "dp1xtp2"])
def test_distributed_muon_update_equals_torch_muon(tmp_path, nproc, tp, extra):
    out = tmp_path / "muon.pt"
    torchrun(nproc, "tests/muon_worker.py", "--out", out, "--tp", tp, "--config", DEBUG, "--run_dir",
             tmp_path / "run", *extra, timeout=300)
    result = torch.load(out)
    want = reference(result)
    assert sum(is_muon_matrix(n) for n in want) == 28  # 4 layers x 7 matrices
    for n, w in want.items():
        moved = (w - result["init"][n]).norm()
        err = (result["after"][n] - w).norm() / moved
        assert err <= RTOL, (n, err.item())


@pytest.mark.slow
def test_muon_wsd_checkpoint_loads_at_another_world_size(tmp_path):
    """2 FSDP ranks for 10 steps, saved at step 5; a 1-rank run loaded from that step (its momentum buffers
    resharded by DCP, its WSD schedule recomputed) continues with the uninterrupted run's losses."""
    common = ["--config", DEBUG, "--optim.name", "muon", "--optim.schedule", "wsd", "--optim.decay_fraction", "0.5",
              "--optim.warmup_steps", "2", "--train.steps", "10", "--checkpoint.interval", "5",
              "--train.val_interval", "0"]
    ref, branch = tmp_path / "ref", tmp_path / "branch"
    torchrun(2, "train_fsdp.py", *common, "--run_dir", ref)
    torchrun(1, "train_fsdp.py", *common, "--run_dir", branch, "--checkpoint.load_from",
             ref / "checkpoints" / "step_00000005")
    a, b = losses(ref), losses(branch)
    assert sorted(b) == list(range(6, 11))
    for step in b:
        assert abs(a[step] - b[step]) / a[step] <= 1e-4, step
