"""One base class for bad input, so every command catches one name and prints one line.

Every error a user can fix (a config field, a file, a checkpoint, a run directory) derives
from ``UserError``; its message names the field or file and the fix. The command-line
boundaries catch ``UserError``, print ``error: <message>`` on stderr and exit with status 2.
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input found by the program; the message names the field or file and the fix."""


class ConfigError(UserError):
    """A bad config key or value (TOML or --section.field); the message names the key and the fix."""


class SetupError(UserError):
    """A bad combination found before training (sections, files, world size); names the fields and the fix."""


class TrainingError(UserError):
    """The run cannot go on (e.g. a non-finite gradient); the message says at which step and why."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line: 'Type: message', whitespace collapsed, cut to limit characters.

    A DCP CheckpointException (whose text is a traceback) becomes its first rank's exception.
    """
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = next(iter(failures.items()))
        return f"rank {rank}: {one_line(exc, limit)}"
    message = " ".join(str(e).split())
    text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
