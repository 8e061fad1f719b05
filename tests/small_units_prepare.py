"""prepare.py's command with filesplit.UNIT_BYTES set by --unit_bytes N (first), so a small file has many units.

    python tests/small_units_prepare.py --unit_bytes N <prepare.py's arguments>   # on ranks: ranks.run_ranks
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import prepare  # noqa: E402
from core.cli import exit_command  # noqa: E402
from data_pipeline import filesplit  # noqa: E402


def main() -> int:
    """prepare.main of sys.argv[3:] with filesplit.UNIT_BYTES = int(sys.argv[2]); returns its exit status (a forked
    rank exits with it: tests/ranks.py)."""
    assert sys.argv[1] == "--unit_bytes", "usage: small_units_prepare.py --unit_bytes N prepare-arguments..."
    filesplit.UNIT_BYTES = int(sys.argv[2])
    return prepare.main(sys.argv[3:])


if __name__ == "__main__":
    exit_command(main())
