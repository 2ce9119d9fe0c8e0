"""The precision profile of the churn test's oracle (``benchmarks.profiling.precision_oracle``) at
its tiniest settings: every table has its rows, and each bfloat16 stream reads as its own
adapter's decode more than as any other's."""

from __future__ import annotations

import re

from benchmarks.profiling.precision_oracle import SCORED, STREAMS, main
from tests.e2e.test_reliability_churn import CHURN_PROMPTS


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_profile_prints_its_three_tables(loraplex_home, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(loraplex_home))
    main(["--tokens", "12", "--window", "6"])
    out = capsys.readouterr().out

    rounding = _table(out, "| adapter | dtype |")
    assert {(r[0], r[1]) for r in rounding} == {(s, d) for s in STREAMS for d in ("bfloat16", "float16")}
    assert all(re.fullmatch(r"\d+ of 12", r[5]) for r in rounding)

    oracle = _table(out, "| stream | scored by |")
    assert {(r[0], r[1]) for r in oracle} == {(s, o) for s in STREAMS for o in SCORED}
    share = {(r[0], r[1]): int(r[2].rstrip("%")) for r in oracle}
    for stream in STREAMS:
        others = [share[(stream, o)] for o in SCORED if o != stream]
        assert share[(stream, stream)] > max(others), (stream, share)

    churn = _table(out, "| adapter | prompt tokens |")
    assert [r[0] for r in churn] == list(CHURN_PROMPTS)
    assert all(int(r[1]) > 0 and re.fullmatch(r"\d+ of \d+", r[2]) for r in churn)
