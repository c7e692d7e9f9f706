"""What users read has no reStructuredText markup: ``kubectl explain`` (the CRDs' descriptions come
from the models' docstrings) and every command's ``--help`` (from its module's docstring)."""

from __future__ import annotations

import re

import pytest

from mixrl import cli
from mixrl.api.crd import crd_files
from mixrl.api.plain_text import plain_text

MARKUP = re.compile(r"``|:(func|data|class|meth|mod|attr|obj):`")


def test_plain_text_turns_literals_and_roles_into_single_backticks() -> None:
    assert (
        plain_text("``a`` or :func:`mixrl.x.y` or :data:`~NAME`, `kept`")
        == "`a` or `mixrl.x.y` or `NAME`, `kept`"
    )
    assert plain_text(None) == ""


def test_the_crds_descriptions_are_plain_text() -> None:
    for name, text in crd_files().items():
        assert not MARKUP.search(text), (name, MARKUP.search(text))


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_commands_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage:") and not MARKUP.search(printed), printed[:2000]
