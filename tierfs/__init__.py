"""tierfs: a tiered checkpoint store for ML training (RAM, peers, Google Cloud Storage)."""

import sys

__version__ = "0.1.0"


def command(*args: str) -> list[str]:
    """The argv that runs this installed tierfs's command line in a new process.

    ``python -P -m tierfs ARGS``: ``-P`` keeps the current directory off
    ``sys.path``. Without it, a folder named ``tierfs`` in the directory the
    command is started from (the parent of a clone, say) is imported instead of
    the installed package, and the child dies with an ImportError.

    Returns:
        the argument list for :mod:`subprocess` (``sys.executable`` first).
    """
    return [sys.executable, "-P", "-m", "tierfs", *args]
