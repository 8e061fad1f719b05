"""train_fsdp.py with injected faults, for the restart tests: a rank SIGKILLs itself during a checkpoint save.

    FAULT=RANK:STEP:WHEN[,RANK:STEP:WHEN ...] torchrun --max-restarts=N ... tests/fault_worker.py <train_fsdp.py's arguments>

The i-th fault applies to attempt i (TORCHELASTIC_RESTART_COUNT i), so each restart meets the
next one and the last attempt runs clean. WHEN is 'write': rank RANK dies as the save of step
STEP starts, while its peers are inside DCP's save waiting for it (on a URL they may have
written their shards: the step is left without its commit marker); or 'commit': rank RANK
(0 commits) dies after every shard and the metadata of step STEP are written, before the
checkpoint is renamed into place; or 'marker' (a checkpoint.dir URL): rank 0 dies with every
shard and the metadata of step STEP uploaded, before the commit marker.
"""
from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
import train_fsdp  # noqa: E402
from core.cli import exit_command  # noqa: E402


def die_at(rank: int, step: int, when: str) -> None:
    """Patch checkpoint.Checkpointer so that this process SIGKILLs itself at the given point."""
    if int(os.environ["RANK"]) != rank:
        return
    name = checkpoint.step_dir("", step)
    if when == "write":
        save = checkpoint.dcp.save

        def dying_save(state, checkpoint_id, **kw):
            if os.path.basename(str(checkpoint_id)) in (name + ".tmp", name):  # local, or a URL (written in place)
                os.kill(os.getpid(), signal.SIGKILL)
            return save(state, checkpoint_id=checkpoint_id, **kw)

        checkpoint.dcp.save = dying_save
    elif when == "commit":
        commit = checkpoint.Checkpointer._commit

        def dying_commit(self, tmp, final):
            if os.path.basename(final) == name:
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(self, tmp, final)

        checkpoint.Checkpointer._commit = dying_commit
    elif when == "marker":
        write_marker = checkpoint.Checkpointer._write_marker

        def dying_marker(self, final):
            if os.path.basename(final) == name:
                os.kill(os.getpid(), signal.SIGKILL)
            return write_marker(self, final)

        checkpoint.Checkpointer._write_marker = dying_marker
    else:
        raise ValueError(f"FAULT: WHEN must be 'write', 'commit' or 'marker', got {when!r}")


if __name__ == "__main__":
    faults = os.environ["FAULT"].split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(faults):
        rank, step, when = faults[attempt].split(":")
        die_at(int(rank), int(step), when)
    exit_command(train_fsdp.main())
