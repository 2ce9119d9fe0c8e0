"""Where the checkout is (tests run from a checkout, never from an installed wheel)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pythonpath_with_repo(pythonpath: str | None = None) -> str:
    """``PYTHONPATH`` for a child that must import this checkout: the checkout first, then the
    given (default: this process's) entries, so packages found only there (an offline site on a
    GPU host) stay importable."""
    rest = os.environ.get("PYTHONPATH") if pythonpath is None else pythonpath
    return os.pathsep.join(p for p in (str(REPO), rest) if p)
