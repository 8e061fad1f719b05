"""train_fsdp.py with the loss of chosen batches blown up, for the rollback tests (a fault that follows the data).

    DIVERGE=A-B[,C-D ...][:RANK[:SCALE]] torchrun ... tests/diverge_worker.py <train_fsdp.py's arguments>

(DIVERGE_ENTRY=train_2d runs train_2d.py's main instead, for a dp x tp layout.)

Multiplies the training loss of the batches of data steps A..B, C..D (1-based, numbered as
[[train.skip]] numbers them) by SCALE (default 1e4; 'nan' makes it NaN) on rank RANK (default:
every rank), so a run diverges there deterministically on CPU. A skipped batch is never drawn,
so its fault never fires: a rollback that skips it recovers, exactly as a fresh run given the
same [[train.skip]] tables. The patch lives here, not in the training path.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_2d  # noqa: E402
import train_fsdp  # noqa: E402
from core.cli import exit_command  # noqa: E402
from data_pipeline.loader import GlobalBatchLoader  # noqa: E402
from parallel import runner as runner_module  # noqa: E402


def inject(spec: str) -> None:
    """Patch the loader (to know the data step of the batch in training) and the runner's loss (to scale it)."""
    ranges, rank, scale = (spec.split(":") + ["", ""])[:3]
    steps = {k for r in ranges.split(",") for a, b in [r.split("-")] for k in range(int(a), int(b) + 1)}
    factor = float(scale or "1e4")
    here = not rank or int(rank) == int(os.environ["RANK"])
    current = {"step": 0}
    next_step, token_loss_sums = GlobalBatchLoader.next_step, runner_module.token_loss_sums

    def drawing(self):
        batches = next_step(self)
        current["step"] = self.state.steps  # the data step of the batch just drawn
        return batches

    def scaled(*args, **kw):
        objective, z_sum = token_loss_sums(*args, **kw)
        return (objective * factor if here and current["step"] in steps else objective), z_sum

    GlobalBatchLoader.next_step = drawing
    runner_module.token_loss_sums = scaled


def main() -> int:
    """The chosen entry's main() on sys.argv, its loss scaled as DIVERGE says; returns its exit status."""
    inject(os.environ["DIVERGE"])
    return (train_2d if os.environ.get("DIVERGE_ENTRY") == "train_2d" else train_fsdp).main()


if __name__ == "__main__":
    exit_command(main())
