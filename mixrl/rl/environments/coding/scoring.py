"""How many of a task's tests passed, read from the test command's output (pure).

A task with ``answers`` (the generated set, :mod:`mixrl.rl.environments.coding.tasks`) is scored on
its runner's line alone, ``mixrl-outputs <nonce> <list>``: the outputs the solution returned, as
canonical JSON, which are compared here with the answers, kept on the host.  The runner holds no
expected output, so nothing in the sandbox says what the right answer is; the nonce and the runner
are not secret from the solution (it runs in the runner's interpreter and can read its command line,
its frames, its files), so a solution can print a line of its own or stop the runner's, but what it
can put in a line is outputs, and only the right outputs score.  Exactly one line with the run's
nonce is believed: none (the runner was stopped) or more than one (someone else printed one) scores
0 of the answers, whatever the exit status or any framework's summary says.

A task without answers (the SWE-style ones), in order, the first that the output holds:

1. mixrl's count line, ``mixrl-tests <nonce> <passed> <total>`` (a runner of the task's own that
   reads the nonce, ``{nonce}`` in the test command), when exactly one line has the run's nonce;
   more than one scores 0.  Such a line is only as good as its runner: a solution that runs in the
   runner's process can read the nonce (its command line) and print the count it likes.
2. pytest's summary line (``3 passed, 1 failed, 2 errors in 0.1s``): passed over all of them.
3. unittest's ``Ran N tests`` with ``OK`` or ``FAILED (failures=a, errors=b)``.
4. Nothing of these: all (1.0) when the command exited 0, else none (0.0).

A ``mixrl-outputs`` line with the run's nonce and no answers scores 0 (there is nothing to compare
it with).

Caveat, said plainly: rules 1-4 take the test command's word, and its tests run in the same
interpreter as the solution they test, so a solution written to attack them can forge its score.
The sandbox keeps such code away from the host; it does not make an in-process test runner
tamper-proof.  Only ``answers`` do not depend on the runner's honesty.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

NONCE_FIELD = "{nonce}"
OUTPUTS_WORD = "mixrl-outputs"
COUNT_WORD = "mixrl-tests"
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


def score(output: str, exit_code: int | None, nonce: str, answers: Sequence[str] = ()) -> TestScore:
    """The share of tests that passed, from the test command's stdout and stderr together.

    ``answers``: the task's (:attr:`mixrl.rl.environments.coding.tasks.CodingTask.answers`); given,
    only the runner's ``mixrl-outputs`` line counts."""
    if answers:
        return _outputs_score(output, nonce, answers)
    if _lines(output, OUTPUTS_WORD, nonce):
        # outputs and no answers to compare them with: a caller that forgot the task's answers (its
        # every episode scores 0, loudly, not 1 by the exit status), or a solution that printed one
        return TestScore(0, 1, "mixrl")
    count_lines = [words for words in _lines(output, COUNT_WORD, nonce) if len(words) == 2]
    if count_lines:
        # One runner prints one line; a second one is someone else's (who read the nonce)
        if len(count_lines) > 1 or not (count_lines[0][0].isdigit() and count_lines[0][1].isdigit()):
            return TestScore(0, 1, "mixrl")
        passed, total = int(count_lines[0][0]), int(count_lines[0][1])
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


def _lines(output: str, word: str, nonce: str) -> list[list[str]]:
    """The words after ``<word> <nonce>`` of each line that starts with them."""
    found = []
    for line in output.splitlines():
        words = line.split()
        if line.startswith(word + " ") and len(words) >= 2 and words[1] == nonce:
            found.append(words[2:])
    return found


def _outputs_score(output: str, nonce: str, answers: Sequence[str]) -> TestScore:
    """The runner's outputs compared with ``answers`` (both canonical JSON).

    Neither the first nor the last line wins: a solution can print a line with the nonce (it can
    read it) before the runner's or after it, so one line is believed when there is exactly one, and
    none otherwise.  Believing one of several would let a solution offer guesses; believing none
    costs it nothing it had earned (the outputs are its own either way)."""
    total = len(answers)
    lines = [line for line in output.splitlines() if line.startswith(f"{OUTPUTS_WORD} {nonce} ")]
    if len(lines) != 1:
        return TestScore(0, total, "mixrl")
    try:
        outputs = json.loads(lines[0][len(OUTPUTS_WORD) + len(nonce) + 2 :])
    except (ValueError, RecursionError):
        return TestScore(0, total, "mixrl")
    if not isinstance(outputs, list) or len(outputs) != total:
        return TestScore(0, total, "mixrl")
    passed = sum(_canonical(got) == answer for got, answer in zip(outputs, answers, strict=True))
    return TestScore(passed, total, "mixrl")


def _canonical(text: object) -> str | None:
    """``text`` (one output's JSON, as the runner wrote it) in canonical form; None when it is not
    JSON (a call that failed is ``null``).  Re-encoded here so that the sandbox's Python and the
    host's need not agree on spelling."""
    if not isinstance(text, str):
        return None
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (ValueError, TypeError, RecursionError):
        return None
