"""The fuzzing suite (issue #14, item 7): generated hostile or careless input, and the properties
"success, or one clear line naming what is wrong; never a 500, a traceback, a hang or lost data".

Real: ``mixrl engine`` as a child process on loopback (tests/engine's tiny transformers model and
its launcher), plain HTTP from this process, the buffer's append-only logs on real temporary
directories, the telemetry readers of ``mixrl run`` and of the trainer's resume.

Reproducible: every ``@given`` runs under :data:`FUZZ` (derandomized, no example database), so CI
tries the same cases on every machine.  The figures (cases tried, clear errors, crashes, data
lost) are counted in :data:`TALLY` and printed at the end of the session; docs/benchmarks.md
records them ("Fuzzing and load").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ..engine.conftest import dense_path as dense_path

FUZZ = settings(
    deadline=None,  # a hang is caught by each request's own timeout, not by hypothesis' clock
    database=None,  # the same cases on every machine, nothing written into the checkout
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    print_blob=False,
)

TALLY: dict[str, Counter[str]] = {}
"""suite -> counts of ``cases``, ``accepted``, ``clear errors``, ``crashes``, ``data lost``..."""


def any_json(max_text: int, max_leaves: int) -> st.SearchStrategy[Any]:
    """Any JSON value: scalars (texts up to ``max_text`` characters), and lists and objects of up to
    three members nested, ``max_leaves`` scalars in all."""
    return st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=max_text)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=max_leaves,
    )


def tally(suite: str) -> Counter[str]:
    """The counter of one suite (created on first use)."""
    return TALLY.setdefault(suite, Counter())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TALLY:
        return
    terminalreporter.section("fuzzing figures (docs/benchmarks.md, Fuzzing and load)")
    for suite, counts in sorted(TALLY.items()):
        shown = ", ".join(f"{name} {counts[name]}" for name in sorted(counts, key=_order))
        terminalreporter.write_line(f"{suite}: {shown}")


def _order(name: str) -> tuple[int, str]:
    first = ("cases", "accepted", "clear errors", "crashes", "data lost")
    return (first.index(name), "") if name in first else (len(first), name)
