"""Context parallelism (parallel.cp, Ulysses) against one process on CPU/gloo: logits of packed windows whose
documents cross the slice boundaries, losses and whole gradients at cp 2, dp 2 x cp 2, cp 2 x tp 2 and cp 4,
and a run killed at cp 2 resumed at cp 1, at plain FSDP 2 and in 2D. Bad layouts are in test_bad_input.py."""
import shutil

import pytest
import torch

from launch import (
    DEBUG,
    REFERENCE_ARGS,
    debug_run,
    debug_run_in_process,
    losses,
    prepared_data_dir,
    start,
    wait_for_step,
    wait_until_unlocked,
)
from nn.documents import document_positions, slice_layout
from test_2d import COMPLETEP, GRAD_RTOL, MUP, packed_tokens, rel  # noqa: F401 (packed_tokens is a fixture)

MHA = ("--model.n_kv_heads", "4")  # 4 query and 4 key/value heads: they split over cp 4 and over cp 2 x tp 2
DOCMASK = ("--model.document_mask", "true")
CP2 = ("--parallel.cp", "2")
LOSS_RTOL = 1e-5


def test_a_slice_keeps_the_positions_and_documents_of_the_whole_window():
    tokens = torch.tensor([[5, 6, 2, 7, 8, 9, 2, 4], [3, 3, 3, 3, 3, 3, 3, 3]])
    doc, pos = document_positions(tokens, 2)
    for lo, hi in [(0, 4), (4, 8), (2, 6)]:
        layout = slice_layout(tokens, lo, hi, True, 2)
        assert torch.equal(layout.positions, pos[:, lo:hi]) and torch.equal(layout.doc, doc)
    causal = slice_layout(tokens, 4, 8, False, 2)
    assert causal.doc is None and causal.positions.tolist() == [[4, 5, 6, 7]] * 2


CP_CASES = [
    (2, 1, (*MHA, *CP2), MHA),
    (2, 1, (*MHA, *DOCMASK, *CP2), (*MHA, *DOCMASK)),
    (4, 1, (*MHA, *DOCMASK, *CP2), (*MHA, *DOCMASK)),
    (4, 2, (*MHA, *DOCMASK, *CP2), (*MHA, *DOCMASK)),
    (4, 1, (*MHA, *DOCMASK, "--parallel.cp", "4"), (*MHA, *DOCMASK)),
    (2, 1, (*MHA, *MUP, *CP2), (*MHA, *MUP)),  # mup's 1/head_dim scores through Ulysses
    (2, 1, (*MHA, *COMPLETEP, *CP2), (*MHA, *COMPLETEP)),
]
CP_IDS = ["causal_cp2", "docmask_cp2", "docmask_dp2xcp2", "docmask_cp2xtp2", "docmask_cp4", "mup_cp2", "completep_cp2"]


@pytest.fixture(scope="module")
def grads(worker, packed_tokens):  # noqa: F811
    """The session's worker, with every run this module compares fetched at once: one launch per world size."""
    path = packed_tokens[0]
    worker.prefetch([(1, 1, *ref, "--logits_of", path) for *_, ref in CP_CASES]
                    + [(n, tp, *layout, "--logits_of", path) for n, tp, layout, _ in CP_CASES])
    return worker


@pytest.mark.parametrize("nproc, tp, layout, reference", CP_CASES, ids=CP_IDS)
@pytest.mark.slow
def test_context_parallel_layouts_match_one_process(grads, packed_tokens, nproc, tp, layout, reference):  # noqa: F811
    path, spans = packed_tokens  # documents cross positions 32, 64 and 96: every slice boundary of cp 2 and 4
    ref, got = grads(1, 1, *reference, "--logits_of", path), grads(nproc, tp, *layout, "--logits_of", path)
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-5
    print(f"{nproc} ranks, tp {tp}, {' '.join(layout)}: max relative difference vs 1 process: loss "
          f"{max(rel(a, b) for a, b in zip(got['losses'], ref['losses'])):.1e}, grad norm "
          f"{max(rel(a, b) for a, b in zip(got['grad_norms'], ref['grad_norms'])):.1e}")
    for step in range(len(ref["losses"])):
        assert rel(got["losses"][step], ref["losses"][step]) <= LOSS_RTOL, f"step {step + 1} loss"
        assert rel(got["grad_norms"][step], ref["grad_norms"][step]) <= LOSS_RTOL, f"step {step + 1} grad norm"
        for name, g in ref["grads"][step].items():
            err = ((got["grads"][step][name] - g).norm() / g.norm()).item()
            assert err <= GRAD_RTOL, f"step {step + 1} {name}: relative gradient error {err:.2e}"


@pytest.mark.slow
def test_sigkill_at_cp2_then_resume_at_cp1_fsdp2_and_in_2d_gives_the_uninterrupted_losses(tmp_path, reference,
                                                                                          monkeypatch, capsys):
    # The conftest reference: 2 FSDP ranks, 10 steps, a checkpoint every 2. Killed at cp 2 (one data-parallel
    # rank) after step 5 or later, the newest checkpoint is step 4 or later.
    rd = tmp_path / "cp2"
    prepared_data_dir(rd)
    p = start(2, "train_fsdp.py", "--config", DEBUG, "--run_dir", rd, *REFERENCE_ARGS, *CP2,
              log_path=tmp_path / "cp2.log")
    wait_for_step(rd, 5, p)
    p.kill()  # SIGKILL to every process, as a node failure
    assert p.wait(timeout=120) != 0, "the run finished before it was killed"
    two_d, fsdp2 = tmp_path / "dp1xtp2", tmp_path / "fsdp2"
    for other in (two_d, fsdp2):
        prepared_data_dir(other)
        shutil.copytree(rd / "checkpoints", other / "checkpoints")
    wait_until_unlocked(rd)  # its workers are gone: the resume starts at once, in this process
    debug_run_in_process(monkeypatch, capsys, rd, *REFERENCE_ARGS)  # cp 1 on one rank (in this process)
    debug_run(2, two_d, *REFERENCE_ARGS, "--train.steps", "7", "--parallel.tp", "2", script="train_2d.py")
    debug_run(2, fsdp2, *REFERENCE_ARGS, "--train.steps", "7")  # 2 data-parallel ranks where there was one
    want = losses(reference)
    for run in (rd, two_d, fsdp2):
        got = losses(run)
        assert max(got) == (10 if run == rd else 7)
        assert max(abs(got[s] - want[s]) / want[s] for s in got) <= 1e-4, run.name
