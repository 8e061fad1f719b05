"""Expert parallelism that borrows the TP or the CP ranks, killed by SIGKILL and resumed at the same layout: the
uninterrupted run's losses bitwise. Its own file, so that xdist gives its six launches to whichever worker is free
(tests/test_moe.py already holds the MoE's longest tests)."""
import pytest

from launch import (
    DEBUG,
    REFERENCE_BATCH,
    losses,
    metrics,
    prepared_data_dir,
    run,
    start,
    wait_for_step,
    wait_until_unlocked,
)
from test_moe import MOE_LAYOUTS, MOE_LOSSES


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-ep2", "cp2-ep2"])
def test_sigkill_with_ep_over_tp_or_cp_then_resume_at_the_same_layout_gives_the_uninterrupted_losses_bitwise(
        tmp_path, layout):
    # 2 ranks, one data-parallel rank: the experts split over ranks that route different tokens, the bias moved by
    # counts summed over them. The checkpoint must carry both, and the resumed run's data and routing must line up.
    n, tp, _, flags = MOE_LAYOUTS[layout]
    script, tp_flags = ("train_2d.py", ["--parallel.tp", str(tp)]) if tp > 1 else ("train_fsdp.py", [])
    args = ["--config", DEBUG, "--train.steps", "6", "--checkpoint.interval", "2", "--train.val_interval", "0",
            *REFERENCE_BATCH, *MOE_LOSSES, *flags, *tp_flags]
    ref, rd = tmp_path / "ref", tmp_path / "killed"
    for d in (ref, rd):
        prepared_data_dir(d)
    run(n, script, *args, "--run_dir", str(ref))
    p = start(n, script, *args, "--run_dir", str(rd), log_path=tmp_path / "killed.log")
    wait_for_step(rd, 3, p)
    p.kill()
    assert p.wait(timeout=120) != 0, "the run finished before it was killed"
    wait_until_unlocked(rd)
    run(n, script, *args, "--run_dir", str(rd))
    want, got = losses(ref), losses(rd)
    assert sorted(got) == list(range(1, 7))
    assert got == want
    assert any(r.get("moe_bias_range", 0) > 0 for r in metrics(rd))  # the bias moved and was carried over
