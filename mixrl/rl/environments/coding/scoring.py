"""How many of a task's tests passed, read from the test command's output (pure).

In order, the first that the output holds:

1. mixrl's result line, ``mixrl-tests <nonce> <passed> <total>`` (the generated tasks' runner
   prints it).  The nonce is fresh for every scoring run and is put into the test command
   (``{nonce}`` in it), so a solution that prints a result line of its own, not knowing the nonce,
   is not believed.  The last line with the right nonce counts.
2. pytest's summary line (``3 passed, 1 failed, 2 errors in 0.1s``): passed over all of them.
3. unittest's ``Ran N tests`` with ``OK`` or ``FAILED (failures=a, errors=b)``.
4. Nothing of these: all (1.0) when the command exited 0, else none (0.0).

Caveat, said plainly: the tests run in the same interpreter as the solution they test, so a
solution written to attack the runner (reading the nonce out of the runner's frames, replacing
``sys.stdout``) can forge its score.  The sandbox keeps such code away from the host; it does not
make an in-process test runner tamper-proof.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NONCE_FIELD = "{nonce}"
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|xfailed|xpassed)\b")
_PYTEST_SUMMARY = re.compile(
    r"^=*\s*(?:\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected)[, ]*)+ in [\d.]+s",
    re.M,
)
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in", re.M)
_UNITTEST_FAILED = re.compile(r"^FAILED \(([^)]*)\)", re.M)


@dataclass(frozen=True)
class TestScore:
    passed: int
    total: int
    source: str
    """Which rule found it: ``mixrl``, ``pytest``, ``unittest`` or ``exit_code``."""

    @property
    def share(self) -> float:
        return self.passed / self.total if self.total else 0.0


def test_command_for(template: str, nonce: str) -> str:
    return template.replace(NONCE_FIELD, nonce)


def score(output: str, exit_code: int | None, nonce: str) -> TestScore:
    """The share of tests that passed, from the test command's stdout and stderr together."""
    mine = [line.split() for line in output.splitlines() if line.startswith("mixrl-tests ")]
    believed = [words for words in mine if len(words) == 4 and words[1] == nonce]
    if believed and believed[-1][2].isdigit() and believed[-1][3].isdigit():
        passed, total = int(believed[-1][2]), int(believed[-1][3])
        return TestScore(min(passed, total), total, "mixrl")
    summaries = _PYTEST_SUMMARY.findall(output)
    if summaries:
        counts: dict[str, int] = {}
        for number, kind in _PYTEST_COUNT.findall(summaries[-1]):
            counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(number)
        passed = counts.get("passed", 0) + counts.get("xfailed", 0)
        total = passed + counts.get("failed", 0) + counts.get("error", 0) + counts.get("xpassed", 0)
        if total:
            return TestScore(passed, total, "pytest")
    ran = _UNITTEST_RAN.findall(output)
    if ran and int(ran[-1]) > 0:
        total = int(ran[-1])
        failed = 0
        failures = _UNITTEST_FAILED.findall(output)
        if failures:
            for part in failures[-1].split(","):
                name, _, number = part.strip().partition("=")
                if name in ("failures", "errors") and number.isdigit():
                    failed += int(number)
        return TestScore(max(total - failed, 0), total, "unittest")
    return TestScore(1 if exit_code == 0 else 0, 1, "exit_code")
