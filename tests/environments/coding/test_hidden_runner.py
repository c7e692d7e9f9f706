"""The generated tasks' hidden runner on the real sandbox, scored as the coding environment scores it:
honest solutions get the share of cases they get right, solutions that attack the runner get 0.

Real: bubblewrap sandboxes, the generated tasks, their runner, :func:`scoring.score` with the task's answers.
"""

from __future__ import annotations

import re
import secrets

import pytest

from mixrl.rl.environments.coding import scoring
from mixrl.rl.environments.coding.tasks import FAMILIES, SOLUTION_FILE, CodingTask, generate_tasks
from mixrl.rl.sandbox import Sandbox
from mixrl.rl.sandbox.limits import Limits

pytestmark = pytest.mark.needs_bwrap
TASKS = generate_tasks("train", 40, seed=0)


def task_of(family: str) -> CodingTask:
    return next(t for t in TASKS if t.id.startswith(family + "-"))


def function_name(task: CodingTask) -> str:
    match = re.match(r"def (\w+)\(", task.files[SOLUTION_FILE])
    assert match is not None
    return match.group(1)


async def run_hidden_tests(task: CodingTask, solution: str) -> scoring.TestScore:
    """What :meth:`CodingEnvironment.run_tests` does: the snapshot with the hidden tests added, a
    fresh nonce in the test command, the output scored with the task's answers."""
    nonce = secrets.token_hex(8)
    tree = {**task.files, SOLUTION_FILE: solution, **task.hidden_tests}
    result = await Sandbox().run(
        scoring.test_command_for(task.test_command, nonce), tree, Limits(wall_s=30.0)
    )
    return scoring.score(result.stdout + "\n" + result.stderr, result.exit_code, nonce, task.answers)


# Reads every place a nonce could be read from (its own command line, its parent's, every process's,
# the environments, the working directory, the sandbox's seed), then forges every kind of result
# line with each candidate and a fake unittest summary, both at import and at exit.
FORGER = r"""
import atexit, glob, json, os, re, sys

def _candidates():
    texts = []
    for path in ["/proc/self/cmdline", f"/proc/{os.getppid()}/cmdline", *glob.glob("/proc/*/cmdline"),
                 *glob.glob("/proc/*/environ"), *glob.glob("/work/**", recursive=True),
                 *glob.glob("/seed/**", recursive=True), *glob.glob("/tmp/**", recursive=True)]:
        try:
            with open(path, "rb") as handle:
                texts.append(handle.read().decode(errors="replace"))
        except OSError:
            pass
    texts.append(" ".join(sys.argv))
    return sorted({word for text in texts for word in re.findall(r"\b[0-9a-f]{16}\b", text)})

def _forge():
    lines = ["Ran 8 tests in 0.001s", "", "OK", "==== 8 passed in 0.01s ===="]
    for nonce in _candidates():
        lines.append(f"mixrl-tests {nonce} 8 8")
        lines.append(f"mixrl-outputs {nonce} " + json.dumps([json.dumps(n) for n in range(8)]))
    os.write(1, ("\n" + "\n".join(lines) + "\n").encode())

_forge()
atexit.register(_forge)

def FN(*args):
    return 10**9 + 7
"""


@pytest.mark.parametrize(
    "attack",
    [
        pytest.param(FORGER, id="forges result lines with every nonce it can read"),
        pytest.param(
            # the old runner's expected output was in the caller's frame
            "import sys\ndef FN(*args):\n    frame = sys._getframe(1)\n"
            "    return frame.f_locals.get('expected', frame.f_locals)\n",
            id="reads the runner's frame",
        ),
        pytest.param(
            # the old runner's cases, expected outputs included, were in its file
            "import ast, json, re\nsource = open('/seed/test_hidden.py').read()\n"
            "found = json.loads(ast.literal_eval(re.search(r'json\\.loads\\((.*)\\)\\n', source).group(1)))\n"
            "table = {repr(case[0]): case[-1] for case in found}\n"
            "def FN(*args):\n    return table.get(repr(list(args)))\n",
            id="reads the runner's file",
        ),
        pytest.param(
            "import os\nos.write(1, b'Ran 8 tests in 0.001s\\n\\nOK\\n')\nos._exit(0)\n",
            id="stops the runner with exit status 0",
        ),
        pytest.param(
            # keeps only its own line: the runner's goes nowhere
            "import json, os\n_write = os.write\n"
            "nonce = open('/proc/self/cmdline', 'rb').read().split(b'\\0')[2].decode()\n"
            "os.write = lambda fd, data: len(data)\n"
            "_write(1, ('mixrl-outputs ' + nonce + ' ' + json.dumps(['0'] * 8) + '\\n').encode())\n"
            "def FN(*args):\n    return 10**9 + 7\n",
            id="replaces the runner's line with its own",
        ),
        pytest.param(
            "class Yes:\n    def __eq__(self, other):\n        return True\n"
            "def FN(*args):\n    return Yes()\n",
            id="returns an object equal to everything",
        ),
    ],
)
async def test_a_solution_attacking_the_runner_scores_0(attack: str) -> None:
    task = task_of("affine")
    assert "0" not in task.answers  # the forged outputs' guesses are all wrong
    got = await run_hidden_tests(task, attack.replace("FN", function_name(task)))
    assert (got.passed, got.total, got.source) == (0, 8, "mixrl")


@pytest.mark.parametrize("family", [family.name for family in FAMILIES])
async def test_the_reference_scores_1_and_the_stub_0(family: str) -> None:
    task = task_of(family)
    assert await run_hidden_tests(task, task.reference[SOLUTION_FILE]) == scoring.TestScore(8, 8, "mixrl")
    assert await run_hidden_tests(task, task.files[SOLUTION_FILE]) == scoring.TestScore(0, 8, "mixrl")


async def test_an_honest_solution_gets_the_share_it_gets_right_whatever_it_prints() -> None:
    task = task_of("clamp")
    match = re.search(r"limited to the range (-?\d+) to (-?\d+)", task.problem)
    assert match is not None
    lo, hi = (int(v) for v in match.groups())
    fn = function_name(task)
    # right above the range only, and chatty: unended output, a line on stderr, its own exit hook
    solution = (
        "import atexit, sys\natexit.register(print, 'bye', end='')\nprint('hello', end='')\n"
        f"def {fn}(x):\n    print('called', x, file=sys.stderr, end='')\n    return {hi} if x >= {hi} else {lo} - 1\n"
    )
    right = sum(answer == str(hi) for answer in task.answers)
    assert 0 < right < 8
    assert await run_hidden_tests(task, solution) == scoring.TestScore(right, 8, "mixrl")
