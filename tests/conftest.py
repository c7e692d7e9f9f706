"""Suite-wide rules."""

from __future__ import annotations

import shutil

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs_bwrap: runs commands in a bubblewrap sandbox; fails (never skips) when bwrap is absent",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that needs a tool the project's setup installs fails without it: CI must not pass
    having skipped it."""
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
