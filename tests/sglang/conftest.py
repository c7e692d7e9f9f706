"""SGLang's own package, installed test-only by scripts/setup.sh (never into .venv).

Its argument parser is the judge of the operator's SGLang command lines.  Like the Prometheus
tests, these fail rather than skip when the environment is missing: CI must not pass having
skipped them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mixrl.api.resolve import SGLANG_VERSION

PARSE_SCRIPT = Path(__file__).with_name("sglang_parse.py")


def sglang_env_dir() -> Path:
    """Where scripts/setup.sh put the pinned SGLang (``$MIXRL_SGLANG_ENV`` overrides, as there)."""
    default = Path.home() / ".cache" / "mixrl" / f"sglang-{SGLANG_VERSION}"
    return Path(os.environ.get("MIXRL_SGLANG_ENV") or default)


class SGLangParser:
    """SGLang's ``launch_server`` argument parser, in a subprocess on that environment."""

    def __init__(self, env_dir: Path) -> None:
        self.env_dir = env_dir

    def check(self, lines: list[list[str]]) -> tuple[str, list[str | None]]:
        """SGLang's version, and per line None (accepted) or SGLang's own refusal."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "results.json"
            done = subprocess.run(
                [sys.executable, str(PARSE_SCRIPT), str(out)],
                input=json.dumps({"lines": lines}),
                env={**os.environ, "PYTHONPATH": str(self.env_dir)},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"SGLang's parser did not run:\n{done.stderr[-3000:]}"
            answer = json.loads(out.read_text())
        return answer["version"], answer["results"]


@pytest.fixture(scope="session")
def sglang_parser() -> SGLangParser:
    env_dir = sglang_env_dir()
    if not (env_dir / ".mixrl-installed").is_file():
        pytest.fail(
            f"SGLang {SGLANG_VERSION}'s test-only environment is absent at {env_dir}: "
            "run scripts/setup.sh (it installs it there), then rerun"
        )
    return SGLangParser(env_dir)
