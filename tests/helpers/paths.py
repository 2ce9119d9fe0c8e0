"""Where the checkout is (tests run from a checkout, never from an installed wheel)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
