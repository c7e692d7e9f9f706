"""Suite-wide rules (docs/testing.md).

- A test that needs a tool the project's setup installs fails without it (never skips).
- No skip passes: every skip is reported as a failure, except a ``cuda`` test on a machine
  without CUDA (or with too few GPUs) and a ``no_cuda`` test on a machine with CUDA, which this
  file skips itself. The CUDA-only tests are the ``cuda`` ones (``pytest -m cuda``), all in
  :data:`CUDA_TEST_FILES`, which ``scripts/gpu/trainer-check.sh`` runs on a GPU machine.
- ``serial``: a test that must not share a worker with others; ``make test`` runs these one at a
  time in their lanes, and the rest on both cores (pytest-xdist). Besides the tests marked so, every
  ``slow`` test (a multi-process integration run) and everything in tests/cluster and
  tests/devcluster (a control plane, a real node) is serial.
- The suite's timeout (pyproject.toml) bounds a test with its fixtures, except on the real node,
  where it bounds the test alone: the bed's, the chart's and a run's start are bounded by their
  own waits, and would otherwise count against whichever test happens to come first.
- ``control_plane`` and ``real_node``: the serial tests of tests/cluster and tests/devcluster,
  without and with the real-node bed (``real_bed``). ``make test`` runs each in a lane of its own,
  one test at a time: the KWOK control-plane tests (about a sixth of the machine busy) beside the
  tests on both cores, then the real node's beside the rest of the serial ones (whole runs,
  multi-process trainers): scripts/test_lanes.sh.
- Hypothesis runs the ``mixrl`` profile: derandomized and without an example database, so every
  machine tries the same cases (``--hypothesis-profile`` still chooses another).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

try:  # scripts/gpu/ runs the CUDA-only tests with pytest and its plugins alone
    from hypothesis import settings as hypothesis_settings
except ImportError:  # pragma: no cover
    hypothesis_settings = None

if hypothesis_settings is not None:
    # Every @given in the suite names its own max_examples (chosen by what the cases cover: see the
    # test, and docs/testing.md); the profile fixes what must be the same everywhere.
    hypothesis_settings.register_profile(
        "mixrl",
        derandomize=True,  # the same cases on every machine and every run (implies database=None)
        deadline=None,  # shared 2-core machines: a slow example is load, not a bug (tests that mean a deadline set one)
        print_blob=False,
    )
    hypothesis_settings.load_profile(os.environ.get("MIXRL_HYPOTHESIS_PROFILE", "mixrl"))

TESTS = Path(__file__).parent
SERIAL_DIRECTORIES = (TESTS / "cluster", TESTS / "devcluster")
"""Serial as a whole (their files belong to the control-plane and real-node work, which marks nothing)."""

CUDA_TEST_FILES = ("tests/trainer/test_megatron.py",)
"""Every file holding a ``cuda`` test: scripts/gpu/trainer-check.sh runs them on a GPU machine.
A ``cuda`` test elsewhere fails at collection until its file is named here."""

_ALLOWED_SKIP = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        in_bed_directory = any(item.path.is_relative_to(d) for d in SERIAL_DIRECTORIES)
        if item.get_closest_marker("slow") or in_bed_directory:
            item.add_marker(pytest.mark.serial)
        if in_bed_directory:
            on_real_node = "real_bed" in getattr(item, "fixturenames", ())
            item.add_marker(pytest.mark.real_node if on_real_node else pytest.mark.control_plane)
            limit = config.getoption("timeout", None) or config.getini("timeout")
            if on_real_node and limit:
                # The first real-node test of a session or module also waits for its fixtures: the
                # bed (a kubelet, the images imported: 116-176 s measured here), the chart, a run's
                # first steps, each bounded by its own wait. The suite's limit times the test.
                item.add_marker(pytest.mark.timeout(float(limit), func_only=True))
        if item.get_closest_marker("cuda"):
            where = item.path.relative_to(TESTS.parent).as_posix()
            if where not in CUDA_TEST_FILES:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked cuda but {where} is not in tests/conftest.py's "
                    "CUDA_TEST_FILES (what scripts/gpu/trainer-check.sh runs): add it there"
                )


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that needs a tool the project's setup installs fails without it: CI must not pass
    having skipped it. The one allowed skip: CUDA where there is none (and the reverse)."""
    if item.get_closest_marker("needs_prometheus") and shutil.which("prometheus") is None:
        pytest.fail(
            "the prometheus binary is absent: scripts/setup.sh installs Debian's prometheus package "
            "(as root, with apt-get); install it, then rerun"
        )
    if item.get_closest_marker("needs_bwrap") and shutil.which("bwrap") is None:
        pytest.fail(
            "the bwrap binary is absent: scripts/setup.sh installs Debian's bubblewrap package "
            "(as root, with apt-get); install it, then rerun"
        )
    cuda = item.get_closest_marker("cuda")
    if cuda is not None:
        wanted, have = int(cuda.kwargs.get("gpus", 1)), _cuda_devices()
        if have < wanted:
            reason = f"needs CUDA: {wanted} GPU{'s' * (wanted > 1)}, this machine has {have}"
            item.stash[_ALLOWED_SKIP] = reason
            pytest.skip(reason)
    if item.get_closest_marker("no_cuda") and _cuda_devices() > 0:
        item.stash[_ALLOWED_SKIP] = "needs a machine without CUDA"
        pytest.skip(item.stash[_ALLOWED_SKIP])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Every skip is a failure unless this file made it for CUDA: CI cannot pass by skipping."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _ALLOWED_SKIP not in item.stash:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, and a skip fails in this suite (tests/conftest.py: only the cuda and no_cuda "
            f"markers may skip): {report.longrepr}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    """A module that skips itself at import (``pytest.importorskip``, ``allow_module_level``)
    is a collection error, for the same reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped itself, and a skip fails in this suite: {report.longrepr}"
        )


# --- the fuzzing tallies across xdist workers (tests/fuzz/conftest.py prints them without xdist) ---


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand the fuzz suites' tallies to the controller."""
    config = session.config
    if hasattr(config, "workeroutput"):
        from_fuzz = _fuzz_tally()
        config.workeroutput["mixrl_fuzz_tally"] = {suite: dict(c) for suite, c in from_fuzz.items()}


def _fuzz_tally() -> dict[str, Counter[str]]:
    import sys

    module = next((m for name, m in sys.modules.items() if name.endswith("fuzz.conftest")), None)
    return getattr(module, "TALLY", {}) if module is not None else {}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the xdist controller: add up the tallies the workers sent."""
    sent = getattr(node, "workeroutput", {}).get("mixrl_fuzz_tally", {})
    for suite, counts in sent.items():
        WORKER_TALLIES.setdefault(suite, Counter()).update(counts)


WORKER_TALLIES: dict[str, Counter[str]] = {}
"""suite -> the fuzz counts the xdist workers reported (empty without xdist)."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not WORKER_TALLIES:
        return
    terminalreporter.section("fuzzing figures (docs/benchmarks.md, Fuzzing and load; all workers)")
    first = ("cases", "accepted", "clear errors", "crashes", "data lost")
    for suite, counts in sorted(WORKER_TALLIES.items()):
        order = sorted(counts, key=lambda n: (first.index(n), "") if n in first else (len(first), n))
        terminalreporter.write_line(f"{suite}: " + ", ".join(f"{n} {counts[n]}" for n in order))
