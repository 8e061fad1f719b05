"""FSDP on 2 ranks and train_2d.py (TP/SP inside a node, FSDP2 across) against one process on CPU/gloo: losses and
whole gradients, replicated norm weights, checkpoints shared with train_fsdp.py both ways, and
layouts that cannot split failing before any collective."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import train_2d
from config import parse_config
from launch import DEBUG, GRAD_STEPS, REFERENCE_BATCH, ROOT, debug_run, losses, metrics, prepared_data_dir
from model import PRESETS, ModelArgs, Transformer
from parallel import distributed
from parallel.layout import Layout, ParallelConfig

STEPS = GRAD_STEPS  # of the conftest `worker` fixture
FAST = ["--checkpoint.interval", "1000", "--train.val_interval", "0"]
LOSS_RTOL = 1e-5
# Per-tensor relative L2 error of a whole gradient; reduction order alone gives ~2e-6 here,
# a gradient missing a reduction over TP or DP is off by O(1).
GRAD_RTOL = 2e-5
DOCMASK_LAYOUTS = [(1, 1), (2, 1), (2, 2)]  # (ranks, tp) of the document-masked logits test


@pytest.fixture(scope="module")
def packed_tokens(tmp_path_factory):
    """(path of a torch.save'd (2, 128) token batch, [(row, start, end)] of its documents): packed windows
    of the debug model's vocabulary, [EOT] = 2 before each document, row 0 starting inside one."""
    gen = torch.Generator().manual_seed(0)
    rows, spans = [], []
    for row, (head, lengths) in enumerate([(10, [40, 30, 48]), (0, [50, 20, 58])]):
        parts, start = [torch.randint(3, 4096, (head,), generator=gen)], 0
        if head:
            spans.append((row, 0, head))
            start = head
        for n in lengths:
            parts += [torch.tensor([2]), torch.randint(3, 4096, (n - 1,), generator=gen)]
            spans.append((row, start, start + n))
            start += n
        rows.append(torch.cat(parts))
    path = tmp_path_factory.mktemp("packed") / "tokens.pt"
    torch.save(torch.stack(rows), path)
    return str(path), spans


@pytest.mark.parametrize("nproc, tp", DOCMASK_LAYOUTS, ids=["ws1", "fsdp2", "dp1xtp2"])
@pytest.mark.slow
def test_document_masked_logits_equal_each_document_alone(grads, packed_tokens, nproc, tp):
    path, spans = packed_tokens
    got = grads(nproc, tp, *DOCMASK, "--logits_of", path)["logits"]
    # The reference: the same initial weights in one process, each document alone from position 0.
    model = Transformer(ModelArgs(**PRESETS["debug"], document_mask=True))
    model.init_weights(seed=0)
    tokens = torch.load(path)
    with torch.no_grad():
        for row, a, b in spans:
            alone = model(tokens[row:row + 1, a:b])[0]
            assert (got[row, a:b] - alone).abs().max().item() <= 1e-5, (row, a, b)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


CHUNKED = ("--train.loss_chunk_size", "100")  # 4 x 64 tokens a micro-batch: 3 chunks, the last one short
DOCMASK = ("--model.document_mask", "true")
HSDP = ("--parallel.dp_replicate", "2")
Z_LOSS = ("--train.z_loss", "0.01")  # 100x PaLM's, so that the term moves the gradients measurably
MUP = ("--model.parametrization", "mup", "--model.base_dim", "64")
COMPLETEP = ("--model.parametrization", "completep", "--model.base_dim", "64", "--model.base_n_layers", "2")


LAYOUT_CASES = [
    (2, 1, (), ()),  # plain FSDP on 2 ranks: same initial weights, losses and gradients as 1 process
    (2, 2, ("--train.micro_batch_size", "2"), ()),  # and 4 accumulated micro-batches against one batch of 8
    (4, 2, (), ()),
    # The chunked loss against the full-logits loss of one process, with accumulation; under TP
    # loss_parallel is used instead (the setting must change nothing there).
    (1, 1, (*CHUNKED, "--train.micro_batch_size", "4"), ()),
    (2, 1, (*CHUNKED, "--train.micro_batch_size", "2"), ()),
    (2, 2, (*CHUNKED, "--train.micro_batch_size", "4"), ()),
    # Document masking: every layout trains as one process with the same mask.
    (2, 1, DOCMASK, DOCMASK),
    (2, 2, DOCMASK, DOCMASK),
    # HSDP: sharded inside a replica, all-reduced across replicas; the norm must not count replicas twice.
    (4, 1, (), ()),
    (4, 1, HSDP, ()),
    (4, 2, HSDP, ()),
    # The z-loss vocabulary-parallel (its logsumexp from the shards) against full logits in one process, with the
    # blocks compiled under TP (the first one is given the embedding's output while its reduce-scatter is in flight).
    (2, 2, (*Z_LOSS, "--train.compile", "true"), Z_LOSS),
    # mup and completep: their multipliers and per-group LRs are the same constants on every layout (each
    # parametrization at FSDP 2 and cp 2 in accept.py transfer too).
    (2, 1, MUP, MUP),
    (2, 2, MUP, MUP),
    (2, 2, COMPLETEP, COMPLETEP),
    (4, 1, (*COMPLETEP, *HSDP), COMPLETEP),
]
LAYOUT_IDS = ["fsdp2", "dp1xtp2_accumulating", "dp2xtp2", "chunked_ws1_accumulating", "chunked_fsdp2_accumulating",
        "chunked_dp1xtp2", "docmask_fsdp2", "docmask_dp1xtp2", "fsdp4", "hsdp2x2", "hsdp2x1xtp2", "zloss_compiled_dp1xtp2",
        "mup_fsdp2", "mup_dp1xtp2", "completep_dp1xtp2", "completep_hsdp2x2"]


def _job(overrides: tuple, path: str) -> tuple:
    """The worker's overrides for a layout case: a document-masked case is the logits test's run of its layout (the
    --logits_of forward comes before training and changes nothing in it), one job for both tests."""
    return (*overrides, "--logits_of", path) if overrides == DOCMASK else overrides


@pytest.fixture(scope="module")
def grads(worker, packed_tokens):
    """The session's worker, with every run this module compares fetched at once: one launch per world size."""
    path = packed_tokens[0]
    worker.prefetch([(1, 1, *_job(ref, path)) for *_, ref in LAYOUT_CASES]
                    + [(n, tp, *_job(o, path)) for n, tp, o, _ in LAYOUT_CASES]
                    + [(n, tp, *DOCMASK, "--logits_of", path) for n, tp in DOCMASK_LAYOUTS] + [(4, 2)])
    return worker


@pytest.mark.parametrize("nproc, tp, overrides, reference", LAYOUT_CASES, ids=LAYOUT_IDS)
@pytest.mark.slow
def test_layouts_match_one_process_in_losses_and_gradients(grads, packed_tokens, nproc, tp, overrides, reference):
    path = packed_tokens[0]
    ref, got = grads(1, 1, *_job(reference, path)), grads(nproc, tp, *_job(overrides, path))
    # Initial weights do not depend on world size or layout: bit for bit.
    assert got["init"].keys() == ref["init"].keys()
    assert all(torch.equal(got["init"][k], v) for k, v in ref["init"].items())
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    print(f"{nproc} ranks, tp {tp}, {' '.join(overrides)}: max relative difference vs 1 process: loss "
          f"{max(rel(a, b) for a, b in zip(got['losses'], ref['losses'])):.1e}, grad norm "
          f"{max(rel(a, b) for a, b in zip(got['grad_norms'], ref['grad_norms'])):.1e}")
    for step in range(STEPS):
        assert rel(got["losses"][step], ref["losses"][step]) <= LOSS_RTOL, f"step {step + 1} loss"
        assert rel(got["grad_norms"][step], ref["grad_norms"][step]) <= LOSS_RTOL, f"step {step + 1} grad norm"
        want, have = ref["grads"][step], got["grads"][step]
        assert have.keys() == want.keys()
        for name, g in want.items():
            assert have[name].shape == g.shape, name
            err = ((have[name] - g).norm() / g.norm()).item()
            assert err <= GRAD_RTOL, f"step {step + 1} {name}: relative gradient error {err:.2e}"


@pytest.mark.slow
def test_replicated_norm_weights_stay_identical_across_tp_ranks(grads):
    # Their gradients are compared with one process above: each TP rank sees a slice of the
    # sequence, so an unreduced gradient would be a partial sum.
    spread = grads(4, 2)["replicated"]
    n_layers = PRESETS["debug"]["n_layers"]
    norms = {f"layers.{i}.{n}.weight" for i in range(n_layers) for n in ("attention_norm", "ffn_norm")}
    assert set(spread) == norms | {"norm.weight"}
    assert all(v == 0.0 for v in spread.values()), spread


LAYOUTS = {  # name: (ranks, script, overrides)
    "fsdp2": (2, "train_fsdp.py", ()),
    "hsdp2x2": (4, "train_fsdp.py", HSDP),
    "dp2xtp2": (4, "train_2d.py", ("--parallel.tp", "2")),
}
# Each layout saves and the next resumes, round the cycle: each layout loads another's checkpoint (of another world
# size or script) and is loaded by another. The first is the conftest reference's step-2 checkpoint (fsdp2,
# train_fsdp.py): the chain's runs are its steps 3, 4, 5. (Other moves: test_checkpoint.py 2 <-> 1 rank,
# test_context_parallel.py and test_pipeline.py to train_2d.py and 1 rank.)
CHAIN = ["fsdp2", "hsdp2x2", "dp2xtp2", "fsdp2"]
FIRST = 2


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_hsdp_and_2d_and_continue_the_run(tmp_path, reference):
    # One step per link in one run directory; DCP reshards at every change of layout and world size.
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    start = f"step_{FIRST:08d}"
    shutil.copytree(reference / "checkpoints" / start, rd / "checkpoints" / start)
    for step, name in enumerate(CHAIN[1:], start=FIRST + 1):
        nproc, script, overrides = LAYOUTS[name]
        # All steps are in the LR warmup, so the schedule does not depend on train.steps.
        debug_run(nproc, rd, "--train.steps", str(step), "--checkpoint.interval", "1", "--train.val_interval", "0",
                  *REFERENCE_BATCH, *overrides, script=script, timeout=240)
    steps = list(range(FIRST + 1, FIRST + len(CHAIN)))
    assert [r["step"] for r in metrics(rd) if "loss" in r] == steps  # each run resumed
    uninterrupted, got = losses(reference), losses(rd)
    errors = {f"{CHAIN[i]}->{CHAIN[i + 1]}": rel(got[step], uninterrupted[step]) for i, step in enumerate(steps)}
    print("relative loss difference vs the uninterrupted run:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) <= LOSS_RTOL, errors


BAD_LAYOUTS = [
    (["--parallel.tp", "3"], 6, "model.n_heads (4) is not divisible by parallel.tp (3)"),
    (["--parallel.tp", "4"], 4, "model.n_kv_heads (2) is not divisible by parallel.tp (4)"),
    (["--parallel.tp", "2", "--model.ffn_dim", "385"], 4, "model.ffn_dim (385) is not divisible by parallel.tp (2)"),
    (["--parallel.tp", "2", "--data.seq_len", "127"], 4, "data.seq_len (127) is not divisible by parallel.tp (2)"),
    (["--parallel.tp", "2"], 3, "world size 3 is not divisible by parallel.tp (2)"),
]


@pytest.mark.parametrize("argv, world_size, message", BAD_LAYOUTS, ids=lambda v: str(v))
def test_bad_layout_fails_before_the_process_group(monkeypatch, capsys, tmp_path, argv, world_size, message):
    def reached(*args, **kwargs):
        raise AssertionError("the process group was being created: the layout was not checked first")

    monkeypatch.setattr(distributed, "init_distributed", reached)
    monkeypatch.setattr(torch.distributed, "init_process_group", reached)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    rd = tmp_path / "run"
    rc = train_2d.main(["--config", DEBUG, "--run_dir", str(rd), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    if "world size" not in message:
        assert "use parallel.tp in [1, 2]" in err or "use parallel.tp in [1]" in err
    assert not rd.exists()  # checked before config.validate, which creates the run directory


def test_more_ranks_than_gpus_on_a_node_fails(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rc = train_2d.main(["--config", DEBUG, "--run_dir", str(tmp_path / "run"), "--train.device", "cuda",
                        "--parallel.tp", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "2 processes on this node (LOCAL_WORLD_SIZE) but 1 visible GPU(s)" in err, err


@pytest.mark.parametrize("env, args, expected", [
    # Two nodes of one rank each: a TP group of 2 would span them.
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, ["--parallel.tp", "2"],
     "parallel.tp (2) does not divide the 1 process(es) of this node (LOCAL_WORLD_SIZE)"),
    ({"WORLD_SIZE": "1"}, ["--parallel.dp_replicate", "2"],
     "parallel.dp_replicate (2) does not divide the 1 data-parallel rank(s) (world size 1 / parallel.tp 1)"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, ["--parallel.tp", "2", "--parallel.dp_replicate", "4"],
     "parallel.dp_replicate (4) does not divide the 2 data-parallel rank(s) (world size 4 / parallel.tp 2)"),
    ({"WORLD_SIZE": "4"}, ["--parallel.dp_replicate", "0"], "parallel.dp_replicate must be >= 1, got 0"),
    # torchrun's variables, read rather than assumed, and checked like any input.
    ({"WORLD_SIZE": "abc"}, [], "WORLD_SIZE is 'abc', not an integer in 1.."),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, [], "LOCAL_WORLD_SIZE is '0', not an integer in 1..2"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, [], "LOCAL_WORLD_SIZE is '4', not an integer in 1..2"),
])
def test_bad_mesh_fails_before_the_process_group(monkeypatch, capsys, tmp_path, env, args, expected):
    def reached(*args, **kwargs):
        raise AssertionError("the process group was being created: the layout was not checked first")

    monkeypatch.setattr(torch.distributed, "init_process_group", reached)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = train_2d.main(["--config", DEBUG, "--run_dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and expected in err, err


@pytest.mark.slow
def test_cli_exits_2_without_waiting_for_peers(tmp_path):
    # Rank 0 of 4 with no peers: creating the process group would block until the timeout.
    port = str(distributed.free_port())
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_2d.py"), "--config", DEBUG,
                           "--run_dir", str(tmp_path / "run"), "--parallel.tp", "4"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: model.n_kv_heads (2) is not divisible by parallel.tp (4)"), proc.stderr


def test_gpu_node_preset_fits_its_layout():
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "llama3_8b_2d.toml")])
    world = 8  # one node of 8 GPUs, as its header says
    train_2d.check_tp_layout(cfg, world)  # the plan's checks; the device check needs the GPUs
    assert world % cfg.parallel.tp == 0
    dp = world // cfg.parallel.tp
    assert cfg.parallel.tp > 1 and cfg.train.dtype == "bfloat16"
    assert cfg.train.global_batch_size % (dp * cfg.train.micro_batch_size) == 0


@pytest.mark.parametrize("world, local, replicate, tp, spans", [
    (16, 8, 1, 1, True),  # plain FSDP over 2 nodes: every all-gather crosses nodes
    (16, 8, 2, 1, False),  # HSDP, a replica per node
    (16, 8, 2, 2, False),
    (16, 8, 1, 2, True),
    (8, 8, 1, 1, False),  # one node
])
def test_a_notice_says_when_fsdp_shard_groups_span_nodes(world, local, replicate, tp, spans):
    note = Layout.of(ParallelConfig(tp=tp, dp_replicate=replicate), world).shard_group_note(local)
    assert bool(note) == spans, note
    if spans:
        assert f"--parallel.dp_replicate {world // local}" in note
