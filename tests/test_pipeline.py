"""Pipeline parallelism (parallel/pipeline.py): stages against one process (losses, clipped norm, gradients), a
checkpoint written at pp 2 resumed on 1 rank, the layer split, and what is refused before any collective."""
import os
import re

import pytest
import torch

import train_fsdp
from launch import (
    DEBUG,
    GRAD_STEPS,
    REFERENCE_BATCH,
    before_any_collective,
    losses,
    metrics,
    prepared_data_dir,
    refused,
    start,
    train_in_process,
    wait_for_step,
    wait_until_unlocked,
)
from model import ModelArgs, Transformer
from parallel import distributed
from parallel.compose import pipeline_notice
from parallel.layout import ParallelConfig
from parallel.pipeline import default_microbatches
from parallel.pipeline_stages import PassThrough, prune, rank_stages, stage_layers, stage_modules

MHA = ["--model.n_kv_heads", "4"]


def test_layers_split_into_contiguous_stages_the_first_ones_one_longer():
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]
    for n, pp in [(5, 2), (12, 5), (3, 3)]:
        assert sorted(i for s in range(pp) for i in stage_layers(n, pp, s)) == list(range(n))


def test_a_pruned_stage_keeps_the_full_models_names_and_only_its_part():
    args = ModelArgs(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=48, max_seq_len=16)
    full = set(Transformer(args).state_dict())
    parts = []
    for stage in range(2):
        m = Transformer(args)
        prune(m, [stage], 2)
        parts.append(set(m.state_dict()))
        assert isinstance(m.layers[2 if stage == 0 else 0], PassThrough)
    assert parts[0] | parts[1] == full and not parts[0] & parts[1]
    assert "tok_embeddings.weight" in parts[0] and "output.weight" in parts[1] and "norm.weight" in parts[1]


@pytest.mark.parametrize("schedule, order, layer3", [("Interleaved1F1B", [[0, 2], [1, 3]], (0, 2)),
                                                     ("ZBVZeroBubble", [[0, 3], [1, 2]], (1, 2))])
def test_stages_run_in_turn_across_ranks_give_the_whole_models_logits(schedule, order, layer3):
    # 4 stages on 2 ranks: in loop order (Interleaved1F1B) rank 0 runs stages 0 and 2; in V order (ZBVZeroBubble,
    # DualPipeV) stages 0 and 3, and rank 1 the two middle ones. layer3: (rank, stage) of block 3.
    args = ModelArgs(dim=32, n_layers=5, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=48, max_seq_len=16)
    full = Transformer(args)
    ranks = []
    for r in range(2):
        m = Transformer(args)
        prune(m, rank_stages(r, 2, 2, schedule), 4)
        m.load_state_dict({k: v for k, v in full.state_dict().items() if k in m.state_dict()})
        ranks.append(dict(stage_modules(m)))
    assert [sorted(ranks[0]), sorted(ranks[1])] == order
    rank_of = {s: r for r in range(2) for s in order[r]}
    assert "tok_embeddings.weight" in ranks[0][0].state_dict() and "output.weight" in ranks[rank_of[3]][3].state_dict()
    assert set(ranks[layer3[0]][layer3[1]].state_dict()) == {k for k in full.state_dict() if k.startswith("layers.3.")}
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for s in range(4):
        h = ranks[rank_of[s]][s](h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


PP_LAYOUTS = {
    "pp2-1f1b": (2, 1, ["--parallel.pp", "2"]),
    # Against the 1-process run without it: the zero-bubble schedules refuse activation checkpointing, GPipe keeps it.
    "pp2-gpipe-selective-ac": (2, 1, ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe",
                                      "--parallel.pp_microbatches", "4", "--train.activation_checkpointing",
                                      "selective"]),
    "pp2-interleaved": (2, 1, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B"]),
    "pp2-looped-bfs-docmask-chunked": (2, 1, ["--parallel.pp", "2", "--parallel.pp_schedule", "LoopedBFS"]),
    "pp2-fsdp2": (4, 1, ["--parallel.pp", "2"]),
    "pp4": (4, 1, ["--parallel.pp", "4"]),
    "pp2-tp2-moe": (4, 2, ["--parallel.pp", "2"]),
    "pp2-tp2-interleaved": (4, 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B"]),
    "pp2-cp2": (4, 1, ["--parallel.pp", "2", "--parallel.cp", "2"]),
    "pp2-interleaved-zero-bubble": (2, 1, ["--parallel.pp", "2", "--parallel.pp_schedule", "InterleavedZeroBubble"]),
    "pp2-zbv-moe": (2, 1, ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble"]),
    "pp2-fsdp2-dualpipev-muon": (4, 1, ["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV"]),
    "pp2-ep2-interleaved-moe": (4, 1, ["--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_schedule",
                                       "Interleaved1F1B"]),
}
"""id: (ranks, tp, flags): 1F1B, and GPipe with selective activation checkpointing, over 2 stages; 2 stages per
rank (Interleaved1F1B, LoopedBFS and the zero-bubble schedules: 4 stages of one block); 2 stages x FSDP 2 (1F1B, and
DualPipeV), x TP 2 (train_2d.py's plan; with 1F1B an MoE, each TP rank routing its own tokens) and x CP 2; 4 stages of
one block each. A layout named "-docmask", "-muon", "-moe" or "-chunked" and its 1-rank reference both run with
model.document_mask, optim.name muon, a mixture of experts (4 experts top-2, aux loss and bias update, layer 0 dense:
a stage without MoE) or the chunked loss with the z-loss (the last stage takes it in its forward) (SHARED). Features
share a layout where their paths do not meet (document masking is the attention's, the chunked loss the last
stage's): a launch fewer each, for the suite's time."""
SHARED = {"docmask": ["--model.document_mask", "true"], "muon": ["--optim.name", "muon"],
          "moe": ["--model.n_experts", "4", "--model.experts_per_token", "2", "--model.expert_ffn_dim", "192",
                  "--model.moe_aux_loss", "0.01", "--model.moe_first_dense", "1"],
          "chunked": ["--train.loss_chunk_size", "64", "--train.z_loss", "1e-4"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", PP_LAYOUTS)
def test_pipeline_losses_norms_and_gradients_equal_one_process(worker, layout):
    def model(name):  # the debug config's batch of 16: at 8 (one sequence a micro-batch) the noise is 10x larger
        return [*MHA, "--model.n_layers", "4", "--train.global_batch_size", "16",
                *(f for k, v in SHARED.items() if k in name for f in v)]
    worker.prefetch([(1, 1, *model(k)) for k in PP_LAYOUTS] + [(n, tp, *model(k), *more)
                                                                for k, (n, tp, more) in PP_LAYOUTS.items()])
    n, tp, more = PP_LAYOUTS[layout]
    flags = model(layout)
    one, other = worker(1, 1, *flags), worker(n, tp, *flags, *more)
    assert one["losses"] == pytest.approx(other["losses"], rel=1e-5, abs=0)
    assert one["grad_norms"] == pytest.approx(other["grad_norms"], rel=1e-5, abs=0)  # every stage's gradients
    for m1, m2 in zip(one.get("moe", []), other.get("moe", [])):  # load, bias range, aux loss: every stage's layers
        assert m2 == pytest.approx(m1, rel=1e-5, abs=1e-7)
    assert len(one.get("moe", [])) == len(other.get("moe", [])) == (GRAD_STEPS if "moe" in layout else 0)
    for g1, g2 in zip(one["grads"], other["grads"]):  # rank 0's: the first stage's parameters (and the third's)
        assert g2 and set(g2) < set(g1) and "tok_embeddings.weight" in g2
        for name in g2:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_sigkill_at_pp_2_resumed_at_pp_2_x_tp_2_then_on_1_rank_gives_the_uninterrupted_losses_and_val_loss(
        tmp_path, monkeypatch, capsys):
    args = ["--config", DEBUG, "--train.steps", "6", "--checkpoint.interval", "2", "--train.val_interval", "3",
            *REFERENCE_BATCH, *MHA]
    ref, rd = tmp_path / "ref", tmp_path / "killed"
    for d in (ref, rd):
        prepared_data_dir(d)
    train_in_process(monkeypatch, capsys, *args, "--run_dir", ref)  # the 1-rank runs: in this process
    legs = [(2, "train_fsdp.py", ["--parallel.pp", "2"], 3),  # killed after step 3: resumes from step 2
            (4, "train_2d.py", ["--parallel.pp", "2", "--parallel.tp", "2"], 5)]  # from step 2, killed after 5
    for i, (n, script, flags, step) in enumerate(legs):
        p = start(n, script, *args, "--run_dir", str(rd), *flags, log_path=tmp_path / f"killed{i}.log")
        wait_for_step(rd, step, p)
        p.kill()
        assert p.wait(timeout=120) != 0, f"leg {i} finished before it was killed"
    wait_until_unlocked(rd)  # the killed legs' workers are gone: the resume starts at once, in this process
    train_in_process(monkeypatch, capsys, *args, "--run_dir", rd)  # every stage's parameters, whole on 1 rank
    want, got = losses(ref), losses(rd)
    assert sorted(got) == list(range(1, 7))
    assert max(abs(got[s] - want[s]) / want[s] for s in want) <= 1e-5

    def vals(d):
        return {r["step"]: r["val_loss"] for r in metrics(d) if "val_loss" in r}
    assert vals(rd).keys() == vals(ref).keys() == {3, 6}
    assert vals(rd) == pytest.approx(vals(ref), rel=1e-5)  # step 3 validated through the pipeline (x TP)


class _DeadPeer(torch.autograd.Function):
    """The identity whose backward fails as a gloo reduction with a killed peer does."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41644: "
                           "Connection reset by peer")


def test_a_peer_failure_inside_a_pipeline_stage_is_named_as_one():
    # Killed under pp 2 x dp 2, the survivors' FSDP collectives inside a stage's forward or backward failed, and
    # torch's stage wrapped the error ("[Stage 0] failed to run forward"; in stage_backward, "Failed to run stage
    # backward"): training/command.py did not see the peer in it and let the raw traceback through.
    from torch.distributed.pipelining._backward import stage_backward

    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError) as wrapped:
        stage_backward(_DeadPeer.apply(x), torch.ones(3), [x])
    assert "Connection reset by peer" not in str(wrapped.value)  # only its cause says it
    assert distributed.peer_failure(wrapped.value) == "closed its connection (it died or was killed)"
    assert distributed.peer_failure(RuntimeError("Failed to run stage backward")) == ""


@pytest.mark.parametrize("world, argv, msg", [
    (3, ["--parallel.pp", "2"], "world size 3 is not divisible by parallel.pp (2); launch a multiple of 2 processes"),
    (2, ["--parallel.pp", "2", "--model.n_layers", "1"], "parallel.pp (2) is more than model.n_layers (1): every stage "
                                                         "needs a block; use parallel.pp <= 1"),
    (2, ["--parallel.pp", "2", "--parallel.pp_microbatches", "1"], "parallel.pp_microbatches (1) is fewer than "
                                                                    "parallel.pp (2)"),
    (2, ["--parallel.pp", "2", "--parallel.pp_microbatches", "3"], "parallel.pp_microbatches (3) does not divide the "
                                                                    "16 sequences each data-parallel rank runs per "
                                                                    "step; use parallel.pp_microbatches in [2, 4, 8, "
                                                                    "16] or change train.global_batch_size"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "Zippy"], "parallel.pp_schedule 'Zippy' is not a schedule "
                                                                    "here; use one of 1F1B, GPipe, Interleaved1F1B, "
                                                                    "LoopedBFS, InterleavedZeroBubble"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_stages_per_rank", "3",
         "--model.n_layers", "6"], "parallel.pp_schedule ZBVZeroBubble runs exactly 2 stages per rank, and "
                                   "parallel.pp_stages_per_rank is 3; use parallel.pp_stages_per_rank 2 (or 0)"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV", "--parallel.pp_microbatches", "2"],
     "parallel.pp_schedule DualPipeV needs at least as many micro-batches as stages (2 x parallel.pp = 4), and "
     "parallel.pp_microbatches is 2; use parallel.pp_microbatches in [4, 8, 16]"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "zbvzerobubble"], "parallel.pp_schedule 'zbvzerobubble' is "
                                                                           "not a schedule here; did you mean "
                                                                           "'ZBVZeroBubble'?"),
    (1, ["--parallel.pp_schedule", "Zippy"], "parallel.pp_schedule 'Zippy' is not a schedule here"),  # at pp 1 too
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--train.global_batch_size", "5"],
     "train.global_batch_size gives each data-parallel rank 5 sequence(s) per step, and Interleaved1F1B takes none "
     "of its divisors as the count of micro-batches; use train.global_batch_size 2 or a multiple of it"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV", "--train.global_batch_size", "2"],
     "train.global_batch_size gives each data-parallel rank 2 sequence(s) per step, fewer than the 4 micro-batches "
     "DualPipeV needs (2 x parallel.pp): every stage needs a micro-batch; use train.global_batch_size 4"),
    (2, ["--parallel.pp", "2", "--parallel.pp_stages_per_rank", "2"], "parallel.pp_schedule 1F1B runs one stage per "
                                                                       "rank, and parallel.pp_stages_per_rank is 2"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_stages_per_rank", "1"],
     "parallel.pp_schedule Interleaved1F1B runs 2 or more stages per rank, and parallel.pp_stages_per_rank is 1"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--model.n_layers", "3"],
     "parallel.pp x parallel.pp_stages_per_rank (2 x 2) is more than model.n_layers (3)"),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_microbatches", "5"],
     "parallel.pp_schedule Interleaved1F1B runs the micro-batches in rounds (parallel.pp_microbatches // "
     "parallel.pp = 2), which must divide parallel.pp_microbatches (5); use parallel.pp_microbatches in [2, 4, 8, 16]"),
    (2, ["--parallel.pp", "0"], "parallel.pp must be >= 1, got 0"),
    (2, ["--parallel.pp", "2", "--train.global_batch_size", "1"], "train.global_batch_size gives each data-parallel "
                                                                   "rank 1 sequence(s) per step, fewer than "
                                                                   "parallel.pp (2): every stage needs a micro-batch; "
                                                                   "use train.global_batch_size 2 or a multiple of it"),
    (4, ["--parallel.pp", "2", "--train.global_batch_size", "15", "--parallel.pp_microbatches", "2"],
     "train.global_batch_size (15) must be a positive multiple of data-parallel size (2)"),
    (2, ["--parallel.pp", "2", "--train.float8", "tensorwise"], "parallel.pp 2 does not run with train.float8 yet"),
])
def test_bad_pipeline_settings_are_refused_in_one_line(tmp_path, monkeypatch, capsys, world, argv, msg):
    with before_any_collective(monkeypatch, world):
        line = refused(train_fsdp.main, ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *argv], capsys)
    assert msg in line, line
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("world, argv", [
    (2, ["--parallel.pp", "2", "--train.global_batch_size", "1"]),
    (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV", "--train.global_batch_size", "2"]),
    (4, ["--parallel.pp", "2", "--train.global_batch_size", "2", "--parallel.pp_microbatches", "3"]),
    (4, ["--parallel.pp", "4", "--model.n_layers", "4", "--train.global_batch_size", "3",
         "--train.micro_batch_size", "3"]),
])
def test_the_global_batch_remedy_under_pp_is_accepted_as_printed(tmp_path, monkeypatch, capsys, world, argv):
    base = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *MHA, *argv]
    with before_any_collective(monkeypatch, world):
        line = refused(train_fsdp.main, base, capsys)
        fix = re.search(r"use (train\.global_batch_size \d+)", line).group(1).split()
        with pytest.raises(AssertionError, match="a collective started"):  # every check passed
            train_fsdp.main([*base, "--" + fix[0], fix[1]])


def test_pipeline_with_batch_stages_is_refused_before_it_aborts_at_the_first_larger_batch(tmp_path, monkeypatch,
                                                                                          capsys):
    # Launched, this ran step 1 and then aborted in gloo ("Received data size doesn't match expected size"):
    # the stages' receive buffers keep the first step's micro-batch.
    config = tmp_path / "stages.toml"
    config.write_text(open(DEBUG).read() + "\n[[train.batch_stages]]\nstart_step = 1\nglobal_batch_size = 32\n")
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, ["--config", str(config), "--run_dir", str(tmp_path / "run"),
                                         "--parallel.pp", "2", *MHA], capsys)
    assert "parallel.pp 2 does not run with [[train.batch_stages]] yet (docs/pipeline.md)" in line, line
    assert not os.path.exists(tmp_path / "run")


SECOND_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The schedules that crashed, launched, at the first backward with activation checkpointing full or selective
(AttributeError: '_GeneratorContextManager' object has no attribute 'args') and with train.compile ("compiled with
non-empty donated buffers"): their weight-gradient pass is a second backward. The others trained with each."""


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", *SECOND_BACKWARD])
def test_zero_bubble_schedules_refuse_checkpointing_and_compile_in_one_line_and_the_others_take_them(
        tmp_path, monkeypatch, capsys, schedule):
    # 5 micro-batches of 10 sequences where the schedule takes them: Interleaved1F1B, a remedy for the V-shaped
    # schedules, would refuse them (rounds of 2).
    base = ["--config", DEBUG, "--parallel.pp", "2", "--parallel.pp_schedule", schedule, "--train.global_batch_size",
            "10", "--parallel.pp_microbatches", "2" if "Interleaved" in schedule else "5"]
    for ac in ("none", "full", "selective"):
        for compile in ("false", "true"):
            run_dir = tmp_path / f"{ac}-{compile}"
            argv = [*base, "--run_dir", str(run_dir), "--train.activation_checkpointing", ac, "--train.compile",
                    compile]
            with before_any_collective(monkeypatch, 2):
                if schedule not in SECOND_BACKWARD or (ac, compile) == ("none", "false"):
                    with pytest.raises(AssertionError, match="a collective started"):  # every check passed
                        train_fsdp.main(argv)
                    continue
                line = refused(train_fsdp.main, argv, capsys)
                on = [f for f, off in (("train.activation_checkpointing", ac == "none"),
                                       ("train.compile", compile == "false")) if not off]
                assert line.startswith(f"error: parallel.pp_schedule {schedule} does not run with {', '.join(on)} "
                                       f"yet"), line
                if (schedule, ac, compile) == ("ZBVZeroBubble", "full", "false"):  # the command, whole
                    assert line == ("error: parallel.pp_schedule ZBVZeroBubble does not run with "
                                    "train.activation_checkpointing yet: its weight-gradient pass is a second backward "
                                    "through each micro-batch, which the recompute cannot run (docs/pipeline.md); use "
                                    "train.activation_checkpointing none, or parallel.pp_schedule 1F1B"), line
                assert not os.path.exists(run_dir)
                # Each remedy as printed passes every check: the settings off, or the other schedule.
                settings, schedule_fix = re.search(r"; use (.+), or (parallel\.pp_schedule .+)$", line).groups()
                for fix in (settings.split(" and "), schedule_fix.split(" and ")):
                    flags = [w for f in fix for w in ("--" + f.split()[0], f.split()[1])]
                    with pytest.raises(AssertionError, match="a collective started"):
                        train_fsdp.main([*argv, *flags])
    # Named with the other refusals, so that one fix is enough.
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, [*base, "--run_dir", str(tmp_path / "chunked"), "--train.compile", "true",
                                         "--train.float8", "rowwise"], capsys)
    if schedule in SECOND_BACKWARD:
        assert line == (f"error: parallel.pp 2 does not run with train.float8, train.compile (under "
                        f"{schedule}) yet (docs/pipeline.md); use train.float8 off and train.compile false, or "
                        f"parallel.pp 1"), line
    else:
        assert "train.compile" not in line, line


def test_pipeline_settings_at_pp_1_get_a_notice_that_they_do_nothing():
    assert pipeline_notice(ParallelConfig()) == ""
    assert pipeline_notice(ParallelConfig(pp=2, pp_schedule="GPipe", pp_microbatches=4)) == ""
    line = pipeline_notice(ParallelConfig(pp_schedule="GPipe", pp_microbatches=8))
    assert line == ("[train] notice: parallel.pp_schedule GPipe, parallel.pp_microbatches 8 have no effect at "
                    "parallel.pp 1 (no pipeline): they apply from parallel.pp 2 (docs/pipeline.md)")
    assert "parallel.pp_stages_per_rank 2 has no effect" in pipeline_notice(ParallelConfig(pp_stages_per_rank=2))
    assert pipeline_notice(ParallelConfig(), micro_batch_size=4) == ""
    assert "replace train.micro_batch_size 4's gradient accumulation" in pipeline_notice(ParallelConfig(pp=2), 4)


@pytest.mark.parametrize("argv", [
    # 5 micro-batches make rounds of 2, which do not divide 5: the remedy offers only counts every check takes.
    ["--parallel.pp_schedule", "Interleaved1F1B", "--train.global_batch_size", "10", "--parallel.pp_microbatches", "5"],
    ["--parallel.pp_schedule", "DualPipeV", "--parallel.pp_microbatches", "2"],
    ["--parallel.pp_microbatches", "3"],
])
def test_the_micro_batch_remedy_is_accepted_as_printed(tmp_path, monkeypatch, capsys, argv):
    base = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *MHA, "--parallel.pp", "2", *argv]
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, base, capsys)
        fix = re.search(r"use parallel\.pp_microbatches in \[(\d+)", line)
        assert fix, line
        with pytest.raises(AssertionError, match="a collective started"):
            train_fsdp.main([*base, "--parallel.pp_microbatches", fix.group(1)])


@pytest.mark.parametrize("schedule, batch", [("InterleavedZeroBubble", 10), ("DualPipeV", 9)])
def test_the_default_micro_batch_count_is_one_the_schedule_takes(tmp_path, monkeypatch, schedule, batch):
    # The largest divisor of the rank's batch up to 4 x pp, the old default, is refused by the schedule: 5 of 10 (rounds
    # of 2 do not divide 5), 3 of 9 (DualPipeV needs 4 at pp 2). The default is now 2 of 10 and 9 of 9.
    assert default_microbatches(2, batch, schedule) == {10: 2, 9: 9}[batch]
    argv = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *MHA, "--parallel.pp", "2",
            "--parallel.pp_schedule", schedule, "--train.global_batch_size", str(batch)]
    with before_any_collective(monkeypatch, 2), pytest.raises(AssertionError, match="a collective started"):
        train_fsdp.main(argv)
