"""The stability kit and the batch ramp of the recipe: z-loss, the spike guard, [[train.batch_stages]].

References: autograd of the z-loss formula on full logits; a loader of one constant batch for the
token stream of a ramp; the closed form of the schedule in samples; an uninterrupted run for a
SIGKILLed one (Muon, WSD, a batch stage and the spike guard together). The vocabulary-parallel
z-loss is checked against one process in test_2d.py.
"""
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from config import parse_config
from data import PackedCorpus
from data_pipeline.loader import GlobalBatchLoader
from launch import (
    DEBUG,
    losses,
    metrics,
    prepared_data_dir,
    run,
    start,
    train_in_process,
    wait_for_step,
)
from model import PRESETS, ModelArgs, Transformer
from nn.loss import chunked_cross_entropy_sum, token_loss_sums
from optimization.optimizers import OptimConfig, build_optimizer, lr_factor
from training.session import build
from training.step import train_step

Z = 0.01  # 100x PaLM's 1e-4, so that the z term's gradient is far above fp32 noise


def _formula(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The objective as PaLM writes it: sum of CE + z * logsumexp^2, on full fp32 logits."""
    flat = logits.flatten(0, 1)
    return F.cross_entropy(flat, labels.flatten(), reduction="sum") + Z * torch.logsumexp(flat, -1).square().sum()


@pytest.mark.parametrize("chunk", [0, 100])
def test_z_loss_gradient_equals_autograd_of_the_formula(chunk):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**PRESETS["debug"]))
    model.init_weights(seed=0)
    inputs, labels = torch.randint(0, 4096, (2, 2, 64)).unbind(0)
    _formula(model(inputs), labels).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    objective, z_sum = token_loss_sums(model, inputs, labels, chunk, Z)
    objective.backward()
    with torch.no_grad():
        logits = model(inputs).flatten(0, 1)
        assert math.isclose(z_sum.item(), torch.logsumexp(logits, -1).square().sum().item(), rel_tol=1e-5)
        ce = F.cross_entropy(logits, labels.flatten(), reduction="sum")
    assert math.isclose(objective.item(), ce.item() + Z * z_sum.item(), rel_tol=1e-6)
    for n, p in model.named_parameters():
        assert ((p.grad - want[n]).norm() / want[n].norm()).item() <= 1e-5, n
    # The term is really in the gradient: the output layer's differs from the CE-only one.
    model.zero_grad()
    token_loss_sums(model, inputs, labels, chunk, 0.0).objective.backward()
    assert (model.output.weight.grad - want["output.weight"]).norm() > 1e-3 * want["output.weight"].norm()


def test_z_loss_forward_only_chunks_equal_full_logits():
    torch.manual_seed(1)
    hidden, weight, labels = torch.randn(300, 32), torch.randn(500, 32), torch.randint(0, 500, (300,))
    with torch.no_grad():
        got = chunked_cross_entropy_sum(hidden, weight, labels, 64, Z)
        want = _formula((hidden @ weight.t())[None], labels[None])
    assert math.isclose(got.objective.item(), want.item(), rel_tol=1e-6)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rd = tmp_path_factory.mktemp("ramp")
    prepared_data_dir(rd)
    return PackedCorpus(str(rd / "data"), parse_config(["--config", DEBUG]).data)


@pytest.mark.parametrize("dp", [1, 2])
def test_a_batch_ramp_reads_the_same_stream_as_a_constant_batch(corpus, dp):
    # Stages 4 -> 8 at step 3 -> 12 at step 5: 3*4 + 2*8 + 3*12 = 64 samples in 8 steps, each once,
    # in the order a loader of 4 per step draws them; the ranks' slices concatenate to the batch.
    stages = [(3, 8), (5, 12)]
    ramp = [GlobalBatchLoader(corpus, 4, 0, r, dp, seed=0, batch_stages=stages) for r in range(dp)]
    flat = GlobalBatchLoader(corpus, 4, 4, 0, 1, seed=0)
    got, sizes = [], []
    for _ in range(8):
        parts = [torch.cat([x for x, _ in ld.next_step()]) for ld in ramp]
        sizes.append(sum(len(p) for p in parts))
        got.append(torch.cat(parts))
    want = torch.cat([flat.next_step()[0][0] for _ in range(16)])
    assert sizes == [4, 4, 4, 8, 8, 12, 12, 12]
    assert torch.equal(torch.cat(got), want)
    assert ramp[0].state.consumed_samples == 64 == flat.state.consumed_samples


def test_the_schedule_runs_in_samples_across_batch_stages():
    # 16 per step for 16 steps, then 32 for 24: 1024 samples = 64 steps of 16. WSD decays over the last
    # half of the samples, 512 = from position 32, the end of step 24. fn(n) is the factor of step n + 1,
    # placed by the samples at its end: step 25 ends at 34, step 32 at 48 (half-way), step 40 at 64 (min).
    cfg = OptimConfig(schedule="wsd", decay_fraction=0.5, warmup_steps=4, min_lr_ratio=0.1)
    _, sched = build_optimizer(torch.nn.Linear(2, 2), cfg, 40, fused=False, batch_schedule=[(0, 16), (16, 32)])
    fn = sched.lr_lambdas[0]
    assert fn(2) == lr_factor(2, 4, 40, 0.1)  # the warmup counts steps
    assert fn(10) == fn(23) == 1.0
    assert math.isclose(fn(24), 0.1 + 0.9 * (1 - 2 / 32))
    assert math.isclose(fn(31), 0.1 + 0.9 * 0.5)
    assert math.isclose(fn(39), 0.1)
    # Without stages, the schedule is the one of steps.
    _, plain = build_optimizer(torch.nn.Linear(2, 2), cfg, 40, fused=False)
    assert all(plain.lr_lambdas[0](k) == lr_factor(k, 4, 40, 0.1, "wsd", 0.5) for k in range(41))


SPIKE = ["--train.spike_skip", "3", "--train.spike_window", "8", "--optim.warmup_steps", "2"]


@pytest.mark.slow
def test_the_spike_guard_skips_a_planted_spike_and_only_it(tmp_path, single_rank_group):
    prepared_data_dir(tmp_path)
    cfg = parse_config(["--config", DEBUG, "--run_dir", str(tmp_path), "--train.steps", "16", *SPIKE])
    s = build(cfg, 0, 1, torch.device("cpu"), resume=False)
    planted, skipped = 12, []
    for step in range(1, 17):
        batches = s.loader.next_step()
        if step == planted:  # a corrupted batch: every label replaced by a random token
            batches = [(x, torch.randint(0, cfg.model.vocab_size, y.shape)) for x, y in batches]
            before = {n: p.detach().clone() for n, p in s.model.named_parameters()}
        result = train_step(s, batches)
        if result.skipped:
            skipped.append(step)
            assert result.skipped.startswith(("loss spike", "grad_norm spike")), result.skipped
        if step == planted:
            assert all(torch.equal(p, before[n]) for n, p in s.model.named_parameters()), "the spike was applied"
    assert skipped == [planted]
    assert len(s.train_state.recent_losses) == 8 and s.train_state.step == 16


COMMON = ["--train.steps", "14", "--train.seed", "0", "--checkpoint.interval", "3", "--train.val_interval", "0",
          "--optim.name", "muon", "--optim.schedule", "wsd", "--optim.decay_fraction", "0.5",
          "--optim.warmup_steps", "2", "--train.z_loss", "1e-4", "--train.spike_skip", "0.5",
          "--train.spike_window", "3", "--train.global_batch_size", "8"]


def _ramp_config(tmp_path) -> str:
    path = tmp_path / "ramp.toml"
    path.write_text(open(DEBUG).read() + "\n[[train.batch_stages]]\nstart_step = 5\nglobal_batch_size = 16\n")
    return str(path)


@pytest.mark.slow
def test_sigkill_and_resume_with_muon_wsd_a_batch_stage_and_the_spike_guard(tmp_path, monkeypatch, capsys):
    # A guard this tight (0.5 sigma over 3 steps) skips some steps: a resume that lost its windows
    # would decide differently. Killed after step 7 (a stage at 5, saved at 6), resumed at 2 ranks
    # and, from the step-6 checkpoint, at 1 rank.
    cfg = _ramp_config(tmp_path)
    ref, rd, one = tmp_path / "ref", tmp_path / "killed", tmp_path / "one"
    for d in (ref, rd, one):
        prepared_data_dir(d)
    run(2, "train_fsdp.py", "--config", cfg, "--run_dir", ref, *COMMON, "--checkpoint.keep", "0", timeout=300)
    want = losses(ref)
    skipped = [r["step"] for r in metrics(ref) if r.get("skipped")]
    assert skipped and all(r["global_batch_size"] == (8 if r["step"] <= 5 else 16) for r in metrics(ref)
                           if "loss" in r), skipped
    p = start(2, "train_fsdp.py", "--config", cfg, "--run_dir", rd, *COMMON, log_path=tmp_path / "killed.log")
    wait_for_step(rd, 7, p)
    p.kill()
    p.wait(timeout=120)
    run(2, "train_fsdp.py", "--config", cfg, "--run_dir", rd, *COMMON, timeout=300)
    got = losses(rd)
    assert [r["step"] for r in metrics(rd) if "loss" in r] == list(range(1, 15))
    assert [r["step"] for r in metrics(rd) if r.get("skipped")] == skipped
    assert max(abs(got[k] - want[k]) / want[k] for k in want) <= 1e-6
    shutil.copytree(ref / "checkpoints" / "step_00000006", one / "checkpoints" / "step_00000006")
    train_in_process(monkeypatch, capsys, "--config", cfg, "--run_dir", one, *COMMON)  # 1 rank, in this process
    got = losses(one)
    assert sorted(got) == list(range(7, 15))
    assert [r["step"] for r in metrics(one) if r.get("skipped")] == [k for k in skipped if k > 6]
    assert max(abs(got[k] - want[k]) / want[k] for k in got) <= 1e-4
    assert os.path.isdir(one / "checkpoints" / "step_00000014")
