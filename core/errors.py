"""One base class for bad input, so every command catches one name and prints one line.

Every error a user can fix (a config field, a file, a checkpoint, a run directory) derives
from ``UserError``; its message names the field or file and the fix. The command-line
boundaries catch ``UserError``, print ``error: <message>`` on stderr and exit with status 2.
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import types


class UserError(Exception):
    """Bad input found by the program; the message names the field or file and the fix."""


class ConfigError(UserError):
    """A bad config key or value (TOML or --section.field); the message names the key and the fix."""


class SetupError(UserError):
    """A bad combination found before training (sections, files, world size); names the fields and the fix."""


class TrainingError(UserError):
    """The run cannot go on (e.g. a non-finite gradient); the message says at which step and why."""


class PeerError(TrainingError):
    """A peer rank stopped answering or died; raised only on the ranks that saw it, so each reports it."""


class MissingPackageError(UserError):
    """An optional package is not installed; the message names what needs it and the extra that installs it."""


def require(module: str, extra: str | None, what: str, alternative: str = "") -> types.ModuleType:
    """Import module and return it, or raise MissingPackageError naming what needs it and the fix.

    The one check of every optional package (pyproject.toml's optional-dependencies), called
    where a command or config asks for it, before any collective or expensive work. extra:
    the project's extra that installs it (the fix is then pip install -e ".[extra]"), or None
    for a package outside the extras (pip install module). alternative: another fix, e.g.
    "set metrics.tensorboard = false". A module that is present but fails to import (a broken
    install) is refused the same way.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        fix = f'pip install -e ".[{extra}]"' if extra else f"pip install {module}"
        raise MissingPackageError(f"{what} needs the Python package '{module}', which is not installed: {fix}"
                                  + (f"; or {alternative}" if alternative else "")) from None


PEER_REPORT_S = 3.0
"""How long a rank that reports bad input under torchrun waits before its command exits (report), seconds."""


def report(e: UserError) -> None:
    """Tell the user about e once: 'error: <message>' on stderr from rank 0 (or a lone process).

    Bad input found before the process group exists is found alike on every rank, and errors
    found later reach every rank as the same message (distributed.on_rank0, DCP's gathered
    failures), so rank 0 speaks for all. Under torchrun every rank also writes the message
    to its elastic error file (TORCHELASTIC_ERROR_FILE, torch.distributed.elastic's format),
    so torchrun's failure summary shows it, including for a rank that alone failed. A
    PeerError is printed by every rank that raised it: rank 0 may be the one that hung.

    Under torchrun with peers, bad input (not a PeerError) is then followed by a wait of
    PEER_REPORT_S: torchrun's agent stops the other ranks with SIGTERM as soon as one exits, so
    a peer that started later and has not reached the same check yet would leave no error file
    (its line in the summary reads <N/A>), and a rank 0 stopped that way would print no
    'error:' line at all.
    """
    message = f"error: {e}".replace("\n", "\\n")  # a newline inside a name must not split the line
    if int(os.environ.get("RANK", 0)) == 0 or isinstance(e, PeerError):
        print(message, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            # The layout ErrorHandler.record_exception writes; the summary shows py_callstack as "traceback".
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
        if os.environ.get("WORLD_SIZE", "1") != "1" and not isinstance(e, PeerError):
            time.sleep(PEER_REPORT_S)


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line: 'Type: message', whitespace collapsed, cut at a space to limit characters.

    A DCP CheckpointException (whose text is a traceback) becomes its first rank's exception.
    """
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = next(iter(failures.items()))
        return f"rank {rank}: {one_line(exc, limit)}"
    message = " ".join(str(e).split())
    text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    return text if len(text) <= limit else text[:limit - 4].rsplit(" ", 1)[0] + " ..."  # never mid-name
