"""Coding tasks: a repository snapshot with a stub to fill in, a problem statement, hidden tests.

:class:`CodingTask` is what every source of tasks produces: the generated set below, and the
SWE-style loader (:mod:`mixrl.rl.environments.coding.swe`).  The agent sees ``files`` (the
snapshot) and ``problem``; ``hidden_tests`` are added to the snapshot only when the episode is
scored, and ``test_command`` runs them in the sandbox
(:mod:`mixrl.rl.environments.coding.scoring` reads how many passed).  A generated task's hidden
runner holds the inputs only: it prints what the solution returned, and the host compares that with
the task's ``answers``, which never enter a sandbox.

The generated set needs nothing downloaded.  Each *family* is a small Python function with a
reference implementation; its parameters (constants, the function's name) are drawn from a seed,
so :func:`generate_tasks` is deterministic.  Levels grade the difficulty:

1. one-line arithmetic (``return 7 * x + 3``),
2. loops over lists and strings,
3. small algorithms (Fibonacci modulo m, run-length encoding, a digital root in base b).

The expected outputs are computed on the host by running the *reference* (this module's own code,
never the model's).  A task's split is a hash of its family and parameters, so a held-out task never
shares them with a training task whatever sizes are asked for.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from mixrl.rl.environments.base import SPLITS, Split

HELDOUT_BUCKETS = 8
"""One in this many parameter tuples is held out."""
LEVELS: tuple[int, ...] = (1, 2, 3)
SOLUTION_FILE = "solution.py"
HIDDEN_TEST_FILE = "test_hidden.py"
HIDDEN_CASES = 8
VISIBLE_CASES = 2
MAX_OUTPUT_CHARS = 10_000
"""The runner reports an output whose canonical JSON is longer than this as a failure (``null``), so
that its one line stays short; every answer is shorter (:func:`build_task` checks)."""


@dataclass(frozen=True)
class CodingTask:
    """One coding task (whatever its source)."""

    id: str
    split: Split
    problem: str
    files: Mapping[str, str]
    """The repository snapshot the agent starts from: relative path -> text."""
    hidden_tests: Mapping[str, str]
    """Added to the snapshot only for scoring (they replace an agent's file of the same path)."""
    test_command: str
    """Run in the sandbox's ``/work`` after the hidden tests are added; its output is scored."""
    level: int = 0
    """1-3 for generated tasks; 0 for tasks from elsewhere."""
    reference: Mapping[str, str] = field(default_factory=dict)
    """A known-good solution (files to write), when there is one: the oracle of the tests."""
    answers: tuple[str, ...] = ()
    """The hidden cases' expected outputs as canonical JSON (``json.dumps(..., sort_keys=True)``), in
    order, for a runner that prints the outputs it got (``mixrl-outputs``;
    :func:`mixrl.rl.environments.coding.scoring.score` compares them).  Kept on the host: never in
    ``files``, ``hidden_tests`` or the test command.  Empty: the test command counts for itself."""


@dataclass(frozen=True)
class Family:
    """A function family: its statement, reference source and test inputs, from drawn parameters."""

    name: str
    level: int
    names: tuple[str, ...]
    """Function names to draw from."""
    draw: Callable[[random.Random], dict[str, int]]
    statement: str
    """``str.format`` template over the function's name ``fn`` and the drawn parameters."""
    signature: str
    """``fn(...)`` arguments and annotations, e.g. ``x: int`` (``-> ...`` included)."""
    reference: str
    """Template of the reference body's source (indented by four spaces)."""
    inputs: Callable[[random.Random, dict[str, int]], list[tuple[Any, ...]]]
    space: Callable[[], Iterator[dict[str, int]]]
    """Every parameter tuple ``draw`` can return, enumerated: how many distinct tasks the family
    holds (:func:`capacity`) is known without drawing any (a test keeps it equal to ``draw``'s range)."""


def _grid(**ranges: range) -> Callable[[], Iterator[dict[str, int]]]:
    """The space of independently drawn parameters, each ``rng.randint`` over its range."""
    names = list(ranges)
    return lambda: (dict(zip(names, values, strict=True)) for values in itertools.product(*ranges.values()))


def _ints(rng: random.Random, count: int, low: int, high: int) -> list[tuple[Any, ...]]:
    return [(rng.randint(low, high),) for _ in range(count)]


def _lists(rng: random.Random, count: int) -> list[tuple[Any, ...]]:
    return [([rng.randint(-20, 20) for _ in range(rng.randint(0, 9))],) for _ in range(count)]


def _words(rng: random.Random, count: int) -> list[tuple[Any, ...]]:
    letters = "abcxyz"
    return [("".join(rng.choice(letters) for _ in range(rng.randint(0, 10))),) for _ in range(count)]


FAMILIES: tuple[Family, ...] = (
    Family(
        "affine",
        1,
        ("scale", "transform", "adjust"),
        lambda rng: {"a": rng.randint(2, 9), "b": rng.randint(1, 20)},
        "Implement {fn}(x) in solution.py: return {a} times x plus {b}.",
        "x: int) -> int",
        "    return {a} * x + {b}\n",
        lambda rng, p: _ints(rng, 12, -50, 50),
        _grid(a=range(2, 10), b=range(1, 21)),
    ),
    Family(
        "clamp",
        1,
        ("clamp", "bound", "limit_to"),
        lambda rng: {"lo": (lo := rng.randint(-10, 10)), "hi": lo + rng.randint(1, 20)},
        "Implement {fn}(x) in solution.py: return x limited to the range {lo} to {hi} (both included).",
        "x: int) -> int",
        "    return min(max(x, {lo}), {hi})\n",
        lambda rng, p: _ints(rng, 12, p["lo"] - 15, p["hi"] + 15),
        lambda: ({"lo": lo, "hi": lo + width} for lo in range(-10, 11) for width in range(1, 21)),
    ),
    Family(
        "multiple",
        1,
        ("is_multiple", "divides", "fits"),
        lambda rng: {"k": rng.randint(2, 9)},
        "Implement {fn}(x) in solution.py: return True when x is a multiple of {k}, else False.",
        "x: int) -> bool",
        "    return x % {k} == 0\n",
        lambda rng, p: [
            (p["k"] * rng.randint(-6, 6) + rng.choice((0, 0, 1, p["k"] - 1)),) for _ in range(12)
        ],
        _grid(k=range(2, 10)),
    ),
    Family(
        "count_above",
        2,
        ("count_above", "tally", "how_many"),
        lambda rng: {"t": rng.randint(-5, 10)},
        "Implement {fn}(xs) in solution.py: return how many numbers of the list xs are greater than {t}.",
        "xs: list[int]) -> int",
        "    return sum(1 for x in xs if x > {t})\n",
        lambda rng, p: _lists(rng, 12),
        _grid(t=range(-5, 11)),
    ),
    Family(
        "every_nth",
        2,
        ("every_nth", "pick", "stride"),
        lambda rng: {"k": rng.randint(2, 4), "s": rng.randint(0, 2)},
        "Implement {fn}(xs) in solution.py: return the list of every {k}th element of xs, starting at index {s}.",
        "xs: list[int]) -> list[int]",
        "    return xs[{s}::{k}]\n",
        lambda rng, p: _lists(rng, 12),
        _grid(k=range(2, 5), s=range(0, 3)),
    ),
    Family(
        "shift_letters",
        2,
        ("shift", "rotate", "encode"),
        lambda rng: {"k": rng.randint(1, 25)},
        "Implement {fn}(text) in solution.py: shift every lowercase letter a-z of text {k} places forward "
        "in the alphabet, wrapping from z to a; leave other characters alone.",
        "text: str) -> str",
        "    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in text)\n",
        lambda rng, p: _words(rng, 12),
        _grid(k=range(1, 26)),
    ),
    Family(
        "fib_mod",
        3,
        ("fib_mod", "sequence", "nth_term"),
        lambda rng: {"m": rng.randint(7, 97), "a": rng.randint(0, 3), "b": rng.randint(1, 4)},
        "Implement {fn}(n) in solution.py: the sequence starts {a}, {b}, and each later term is the sum of "
        "the two before it; return term n (term 0 is {a}) modulo {m}.",
        "n: int) -> int",
        "    x, y = {a}, {b}\n    for _ in range(n):\n        x, y = y, x + y\n    return x % {m}\n",
        lambda rng, p: _ints(rng, 12, 0, 60),
        _grid(m=range(7, 98), a=range(0, 4), b=range(1, 5)),
    ),
    Family(
        "run_length",
        3,
        ("run_length", "compress", "squeeze"),
        lambda rng: {"min_run": rng.randint(1, 3)},
        "Implement {fn}(text) in solution.py: replace each run of the same character that is at least "
        "{min_run} long by the character followed by the run's length; shorter runs stay as they are.",
        "text: str) -> str",
        "    out, i = [], 0\n    while i < len(text):\n        j = i\n"
        "        while j < len(text) and text[j] == text[i]:\n            j += 1\n"
        "        out.append(text[i] + str(j - i) if j - i >= {min_run} else text[i:j])\n        i = j\n"
        "    return ''.join(out)\n",
        lambda rng, p: _words(rng, 12),
        _grid(min_run=range(1, 4)),
    ),
    Family(
        "digit_root",
        3,
        ("digit_root", "fold_digits", "reduce_digits"),
        lambda rng: {"base": rng.randint(3, 12)},
        "Implement {fn}(n) in solution.py: for n >= 0, repeatedly replace n by the sum of its digits written "
        "in base {base} until it has one digit; return that digit as an int.",
        "n: int) -> int",
        "    while n >= {base}:\n        total = 0\n        while n:\n            total += n % {base}\n"
        "            n //= {base}\n        n = total\n    return n\n",
        lambda rng, p: _ints(rng, 12, 0, 100000),
        _grid(base=range(3, 13)),
    ),
)
FAMILIES_BY_NAME: dict[str, Family] = {family.name: family for family in FAMILIES}


def _split_of(family: str, fn: str, params: Mapping[str, int]) -> Split:
    key = json.dumps([family, fn, sorted(params.items())])
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def _task_id(family: str, fn: str, params: Mapping[str, int]) -> str:
    digest = hashlib.sha256(json.dumps([family, fn, sorted(params.items())]).encode()).hexdigest()[:8]
    return f"{family}-{digest}"


@cache
def _family_counts(name: str) -> dict[Split, int]:
    """A family's distinct task ids per split (ids carry the family's name: no two families share one)."""
    family = FAMILIES_BY_NAME[name]
    ids: dict[Split, set[str]] = {split: set() for split in SPLITS}
    for fn in family.names:
        for params in family.space():
            ids[_split_of(name, fn, params)].add(_task_id(name, fn, params))
    return {split: len(found) for split, found in ids.items()}


def capacity(split: Split, levels: Sequence[int] = LEVELS) -> int:
    """How many distinct tasks of ``split`` :func:`generate_tasks` can yield from ``levels``: every
    name with every parameter tuple of each family (:attr:`Family.space`), counted by task id, as the
    generator dedups them.  A fraction of a second, where generating that many takes minutes: what
    ``mixrl validate`` compares ``rollout.dataset.trainSize`` and ``heldoutSize`` with."""
    return sum(_family_counts(family.name)[split] for family in FAMILIES if family.level in levels)


def reference_source(family: Family, fn: str, params: Mapping[str, int]) -> str:
    """The whole reference ``solution.py``."""
    return f"def {fn}({family.signature}:\n{family.reference.format(**params)}"


def stub_source(family: Family, fn: str, statement: str) -> str:
    return f'def {fn}({family.signature}:\n    """{statement}"""\n    raise NotImplementedError\n'


def _expected(source: str, fn: str, inputs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The reference's outputs: this module's own trusted source, run on the host."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {fn}>", "exec"), namespace)
    return [namespace[fn](*args) for args in inputs]


def hidden_test_source(fn: str, inputs: Sequence[tuple[Any, ...]]) -> str:
    """A self-contained runner that calls ``fn`` on each input and prints what it returned.

    It holds no expected output: a solution runs in its interpreter and can read whatever it holds
    (its frames, its file, its command line with the nonce).  Its one result line,
    ``mixrl-outputs <nonce> <list>``, gives each case's return value as canonical JSON
    (``json.dumps(..., sort_keys=True)``; ``null`` when the call raised, timed out, or its JSON is
    longer than :data:`MAX_OUTPUT_CHARS`), and the host compares them with the task's ``answers``
    (:func:`mixrl.rl.environments.coding.scoring.score`): as canonical JSON, not with ``==``, so an
    object whose ``__eq__`` says yes to everything does not pass.  Each call has a one-second
    wall-clock alarm (``ITIMER_REAL``); the sandbox's limits bound the whole run."""
    encoded = json.dumps([list(args) for args in inputs])
    return f'''"""Hidden tests of {fn} (added at scoring time): the outputs are compared on the host."""
import json, os, signal, sys

def main(nonce):
    inputs = json.loads({encoded!r})
    try:
        from solution import {fn} as candidate
    except BaseException as error:
        print("cannot import {fn} from solution.py:", type(error).__name__, error)
        candidate = None
    outputs = []
    def alarm(signum, frame):
        raise TimeoutError("a case took more than a second")
    signal.signal(signal.SIGALRM, alarm)
    for args in inputs:
        output = None
        if candidate is not None:
            try:
                signal.setitimer(signal.ITIMER_REAL, 1.0)
                output = json.dumps(candidate(*args), sort_keys=True)
            except BaseException as error:
                print("case", args, "raised", type(error).__name__, error)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        outputs.append(output if output is None or len(output) <= {MAX_OUTPUT_CHARS} else None)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    # on a line of its own (after whatever the solution left unended), straight to the descriptor
    line = "\\nmixrl-outputs " + nonce + " " + json.dumps(outputs, separators=(",", ":")) + "\\n"
    data = line.encode()
    while data:
        data = data[os.write(1, data):]

main(sys.argv.pop(1))
'''


def visible_test_source(fn: str, cases: Sequence[tuple[tuple[Any, ...], Any]]) -> str:
    lines = [f"from solution import {fn}", "", ""]
    for number, (args, expected) in enumerate(cases):
        call = ", ".join(repr(a) for a in args)
        lines += [f"def test_example_{number}():", f"    assert {fn}({call}) == {expected!r}", "", ""]
    lines += ["if __name__ == '__main__':"]
    lines += [f"    test_example_{number}()" for number in range(len(cases))]
    lines += ["    print('examples pass')", ""]
    return "\n".join(lines)


def build_task(family: Family, fn: str, params: dict[str, int], rng: random.Random) -> CodingTask:
    statement = family.statement.format(fn=fn, **params)
    source = reference_source(family, fn, params)
    inputs = family.inputs(rng, params)
    cases = list(zip(inputs, _expected(source, fn, inputs), strict=True))
    visible, hidden = cases[:VISIBLE_CASES], cases[VISIBLE_CASES : VISIBLE_CASES + HIDDEN_CASES]
    answers = tuple(json.dumps(expected, sort_keys=True) for _, expected in hidden)
    if any(len(answer) > MAX_OUTPUT_CHARS for answer in answers):
        raise ValueError(f"{family.name}: an answer is longer than MAX_OUTPUT_CHARS ({MAX_OUTPUT_CHARS})")
    return CodingTask(
        id=_task_id(family.name, fn, params),
        split=_split_of(family.name, fn, params),
        problem=f"{statement} Examples are in test_solution.py (run: python test_solution.py).",
        files={
            SOLUTION_FILE: stub_source(family, fn, statement),
            "test_solution.py": visible_test_source(fn, visible),
            "README.md": f"# {fn}\n\n{statement}\n",
        },
        hidden_tests={HIDDEN_TEST_FILE: hidden_test_source(fn, [args for args, _ in hidden])},
        test_command=f"python3 {HIDDEN_TEST_FILE} {{nonce}}",
        level=family.level,
        reference={SOLUTION_FILE: source},
        answers=answers,
    )


def generate_tasks(split: Split, n: int, seed: int, levels: Sequence[int] = LEVELS) -> list[CodingTask]:
    """The first ``n`` distinct tasks of ``split`` drawn from ``seed``, levels in turn."""
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n: must be non-negative, got {n}")
    bad = [level for level in levels if level not in LEVELS]
    if bad or not levels:
        raise ValueError(f"levels: each must be one of {LEVELS}, got {list(levels)}")
    available = capacity(split, levels)
    if n > available:  # at once, rather than after 200 draws per task asked for
        raise ValueError(
            f"n: the families of levels {list(levels)} hold {available} {split} tasks, fewer than {n}"
        )
    families = [family for family in FAMILIES if family.level in levels]
    tasks: dict[str, CodingTask] = {}
    rng = random.Random(f"coding-{seed}")
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > 200 * (n + 10):
            raise ValueError(f"n: the families of levels {list(levels)} gave fewer than {n} {split} tasks")
        family = families[attempts % len(families)]
        fn, params = rng.choice(family.names), family.draw(rng)
        if _split_of(family.name, fn, params) != split:
            continue
        # the inputs' generator depends on the task alone: one id, one task, whatever the seed
        task = build_task(family, fn, params, random.Random(f"{family.name}-{fn}-{params}"))
        tasks.setdefault(task.id, task)
    return list(tasks.values())
