"""The optimizer's LR schedule against its closed form, and which parameters get weight decay.

The references are written out here, not taken from optimizers.py. Optimizer step k = 1..T
(lrs[k - 1] below; the `step` of its metrics.jsonl record) runs at lr k / W for k <= W (linear
warmup to the peak at step W), then cosine decay (Loshchilov & Hutter, SGDR, 2017) from lr at
step W to min_lr at step T, the last: p = (k - W) / (T - W). Weight decay on the 2-D weight
matrices, embeddings and output included, never on the RMSNorm gains (nanoGPT's rule; the
Llama names of this model's parameters).
"""
import math

import pytest

from launch import debug_run_in_process, metrics, prepared_data_dir
from model import ModelArgs, Transformer
from optimization.optimizers import OptimConfig, build_optimizer, reapply_schedule, schedule_notice

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=16)
LR, MIN_LR, WARMUP, TOTAL = 1e-3, 1e-4, 10, 110


def lrs_by_step(cfg: OptimConfig, total_steps: int, n: int) -> list[list[float]]:
    """Every param group's LR for the optimizer steps 1..n (index k - 1), stepped as the trainer does (step, then schedule)."""
    optimizer, scheduler = build_optimizer(Transformer(ARGS), cfg, total_steps, fused=False)
    seen = []
    for _ in range(n):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.fixture(scope="module")
def lrs():
    cfg = OptimConfig(lr=LR, min_lr_ratio=MIN_LR / LR, warmup_steps=WARMUP)
    return lrs_by_step(cfg, TOTAL, TOTAL + 6)


@pytest.mark.parametrize("step, want", [  # step: the index k - 1 of optimizer step k
    (0, LR / WARMUP),                                            # the first update (k = 1): lr / W, not 0
    (4, LR * 5 / WARMUP),                                        # linear warmup: lr k / W
    (WARMUP - 1, LR),                                            # the last warmup step (k = W) reaches the peak
    (WARMUP, MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi / 100)) / 2),  # the cosine's first step
    (WARMUP + 24, MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi / 4)) / 2),  # a quarter of the decay
    (WARMUP + 49, (LR + MIN_LR) / 2),                            # half-way: cos(pi/2) = 0
    (TOTAL - 2, MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * 99 / 100)) / 2),
    (TOTAL - 1, MIN_LR),                                         # the last step, k = T: min LR
    (TOTAL + 5, MIN_LR),                                         # and it stays there
])
def test_lr_schedule_matches_the_closed_form(lrs, step, want):
    assert lrs[step] == pytest.approx([want, want], rel=1e-12), step


def test_lr_without_warmup_decays_from_the_peak_to_zero_at_the_last_step():
    seen = lrs_by_step(OptimConfig(lr=LR, min_lr_ratio=0.0, warmup_steps=0), 4, 5)
    # min_lr 0, W 0: lr (1 + cos(pi k / 4)) / 2 at steps k = 1..4 (the peak is k = 0), then 0
    assert [s[0] for s in seen] == pytest.approx([LR * (1 + math.sqrt(0.5)) / 2, LR / 2,
                                                  LR * (1 - math.sqrt(0.5)) / 2, 0.0, 0.0], rel=1e-12, abs=1e-18)


def test_weight_decay_is_on_exactly_the_weight_matrices_and_every_parameter_is_in_one_group():
    model = Transformer(ARGS)
    optimizer, _ = build_optimizer(model, OptimConfig(weight_decay=0.1), 100, fused=False)
    decayed = [f"layers.{i}.{m}.weight" for i in range(ARGS.n_layers)
               for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                         "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    decayed += ["tok_embeddings.weight", "output.weight"]
    not_decayed = [f"layers.{i}.{m}.weight" for i in range(ARGS.n_layers) for m in ("attention_norm", "ffn_norm")]
    not_decayed += ["norm.weight"]
    name_of = {id(p): n for n, p in model.named_parameters()}
    assert sorted(name_of.values()) == sorted(decayed + not_decayed)  # the list above names every parameter

    by_decay = {}
    for g in optimizer.param_groups:
        by_decay.setdefault(g["weight_decay"], []).extend(name_of[id(p)] for p in g["params"])
    assert set(by_decay) == {0.1, 0.0}
    assert sorted(by_decay[0.1]) == sorted(decayed)
    assert sorted(by_decay[0.0]) == sorted(not_decayed)
    in_groups = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(in_groups) == len(set(in_groups)) == len(name_of)  # each parameter exactly once


D = 22  # WSD: decay over the last decay_fraction 0.2 of TOTAL = 110 steps, round(22) = 22
WSD_START = TOTAL - D  # step 88 is the last at the peak; steps 89..110 decay, q = (k - 88) / 22


@pytest.mark.parametrize("schedule, shape, step, want", [  # step: the index k - 1 of optimizer step k
    ("wsd", "linear", 0, LR / WARMUP),                         # warmup as for cosine
    ("wsd", "linear", WARMUP, LR),                             # stable at the peak ...
    ("wsd", "linear", WSD_START - 1, LR),                      # ... until step 88
    ("wsd", "linear", WSD_START, LR - (LR - MIN_LR) / D),      # step 89: one D-th of the way down
    ("wsd", "linear", WSD_START + 10, (LR + MIN_LR) / 2),      # step 99: half-way down, linear
    ("wsd", "1-sqrt", WSD_START + 10, MIN_LR + (LR - MIN_LR) * (1 - math.sqrt(0.5))),
    ("wsd", "1-sqrt", TOTAL - 1, MIN_LR),                      # the last step, k = T: min LR
    ("wsd", "linear", TOTAL - 1, MIN_LR),
    ("wsd", "linear", TOTAL + 3, MIN_LR),
    ("linear", "linear", WARMUP + 49, (LR + MIN_LR) / 2),      # linear from the peak at W to min at T
    ("linear", "linear", WARMUP + 24, MIN_LR + (LR - MIN_LR) * 0.75),
    ("linear", "linear", TOTAL - 1, MIN_LR),
])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_each_schedule_matches_its_closed_form_for_every_group(name, schedule, shape, step, want):
    cfg = OptimConfig(name=name, lr=LR, min_lr_ratio=MIN_LR / LR, warmup_steps=WARMUP, schedule=schedule,
                      decay_fraction=0.2, decay_shape=shape)
    seen = lrs_by_step(cfg, TOTAL, step + 1)[step]
    assert seen == pytest.approx([want] * (3 if name == "muon" else 2), rel=1e-12), step


def test_muon_takes_exactly_the_blocks_matrices_and_adamw_the_rest():
    model = Transformer(ARGS)
    optimizer, _ = build_optimizer(model, OptimConfig(name="muon", weight_decay=0.1), 100, fused=False)
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = {(g["muon"], g["weight_decay"]): sorted(name_of[id(p)] for p in g["params"])
              for g in optimizer.param_groups}
    matrices = sorted(f"layers.{i}.{m}.weight" for i in range(ARGS.n_layers)
                      for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))
    assert groups[(True, 0.1)] == matrices
    assert groups[(False, 0.1)] == ["output.weight", "tok_embeddings.weight"]
    assert len(groups[(False, 0.0)]) == 2 * ARGS.n_layers + 1  # the norms


def test_schedule_after_loading_follows_this_runs_total_steps():
    """Decay from a checkpoint: a stable WSD run's scheduler state at step k, loaded into a run of N steps,
    gives that run's closed form from step k on (not the saved run's LR)."""
    stable = OptimConfig(lr=LR, min_lr_ratio=MIN_LR / LR, warmup_steps=WARMUP, schedule="wsd", decay_fraction=0.2)
    opt, sched = build_optimizer(Transformer(ARGS), stable, 1000, fused=False)
    k, n = 60, 70  # the branch decays over its last 14 steps, 57..70, so step 61 is already in the decay
    for _ in range(k):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == LR  # the stable run is at the peak
    branch_opt, branch = build_optimizer(Transformer(ARGS), stable, n, fused=False)
    branch_opt.load_state_dict(opt.state_dict())
    branch.load_state_dict(sched.state_dict())
    reapply_schedule(branch)  # what checkpoint.AppState.load_state_dict does
    for step in range(k, n + 1):  # the LR of step step + 1
        want = MIN_LR + (LR - MIN_LR) * (1 - min(1.0, (step + 1 - 56) / 14))
        assert [g["lr"] for g in branch_opt.param_groups] == pytest.approx([want, want], rel=1e-12), step
        branch_opt.step()
        branch.step()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["wsd", "cosine", "linear"])
def test_the_logged_lr_of_the_last_step_is_min_lr_ratio_times_lr(tmp_path, monkeypatch, capsys, schedule):
    # The debug config: lr 3e-3, min_lr_ratio 0.1. 6 steps, warmup 2; WSD decays over the last
    # round(0.5 * 6) = 3 steps (4, 5, 6). The record of step k logs the LR that step k ran at.
    lr, low, total, warmup = 3e-3, 3e-4, 6, 2
    p = [(k - warmup) / (total - warmup) for k in range(3, total + 1)]  # steps 3..6 after the warmup
    after = {"wsd": [lr, lr - (lr - low) / 3, lr - 2 * (lr - low) / 3, low],
             "cosine": [low + (lr - low) * (1 + math.cos(math.pi * x)) / 2 for x in p],
             "linear": [low + (lr - low) * (1 - x) for x in p]}[schedule]
    want = [lr / 2, lr, *after]
    prepared_data_dir(tmp_path)
    debug_run_in_process(monkeypatch, capsys, tmp_path, "--train.steps", str(total), "--optim.warmup_steps",
                         str(warmup), "--optim.schedule", schedule, "--optim.decay_fraction", "0.5",
                         "--train.val_interval", "0", "--checkpoint.interval", "100")  # 1 rank, in this process
    logged = {r["step"]: r["lr"] for r in metrics(tmp_path) if "lr" in r}
    assert sorted(logged) == list(range(1, total + 1))
    assert [logged[k] for k in range(1, total + 1)] == pytest.approx(want, rel=1e-12)
    assert logged[total] == pytest.approx(0.1 * 3e-3, rel=1e-12)  # min_lr_ratio * lr, the expectation


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
@pytest.mark.parametrize("warmup", [4, 5, 6, 9])
def test_a_warmup_that_never_ends_is_noticed_exactly_when_the_lr_never_decays(schedule, warmup):
    """optim.warmup_steps >= train.steps: the schedule never decays, and the start says so naming both fields."""
    total = 5
    lrs = [g[0] for g in lrs_by_step(OptimConfig(lr=LR, min_lr_ratio=0.1, warmup_steps=warmup, schedule=schedule,
                                                 decay_fraction=0.4), total, total)]
    decays = lrs[-1] < max(lrs)  # the reference: the LRs the optimizer ran at, steps 1..train.steps
    notice = schedule_notice(OptimConfig(warmup_steps=warmup, schedule=schedule), total)
    assert bool(notice) == (not decays)
    if notice:
        assert notice == (f"[train] notice: optim.warmup_steps ({warmup}) >= train.steps (5): the LR never leaves its "
                          f"warmup and the '{schedule}' schedule never decays; lower optim.warmup_steps below "
                          f"train.steps to decay")
