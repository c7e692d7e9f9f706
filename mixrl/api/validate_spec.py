"""``mixrl validate FILE|DIR...``: one line per problem (the first 20 of a document, then how many more);
exit 0 valid, 1 invalid, 2 usage error."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from mixrl.api.errors import InvalidSpec, Problem
from mixrl.api.loader import ManifestUnreadable, parse_document, read_documents
from mixrl.api.models import RLRun
from mixrl.api.plain_text import plain_text

RunCheck = Callable[[RLRun], list[str]]
"""More checks of a valid RLRun that need more than the api (one line per problem): the ``mixrl``
command passes :func:`mixrl.rl.environments.validate_cmd.check_environment`, which imports the
spec's environment; mixrl.api itself imports nothing of the runtime."""

MAX_PROBLEMS = 20
"""Problems printed per document; a document of garbage has thousands, and the first ones say enough."""


def _expand(paths: list[str]) -> tuple[list[Path], list[str]]:
    """The files to read, and one usage-error line per directory without any."""
    files: list[Path] = []
    empty: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:  # validating nothing must not read as "all valid"
                empty.append(f"{path}: no *.yaml or *.yml files")
            files += found
        else:
            files.append(path)
    return files, empty


def _lines(label: str, problems: list[Problem]) -> list[str]:
    lines = [f"{label}: {problem}" for problem in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        lines.append(f"{label}: ... and {len(problems) - MAX_PROBLEMS} more problems")
    return lines


def main(argv: list[str], run_check: RunCheck | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mixrl validate", description=plain_text(__doc__))
    parser.add_argument("paths", nargs="+", metavar="FILE", help="RLRun YAML files or directories of them")
    parser.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    if run_check is not None:
        parser.add_argument(
            "--no-import",
            action="store_true",
            help="do not import rollout.environment (one that only the rollout image has): check its form only",
        )
    args = parser.parse_args(argv)
    if getattr(args, "no_import", False):
        run_check = None

    files, empty = _expand(args.paths)
    for line in empty:
        print(line, file=sys.stderr)
    invalid, usage_error = False, bool(empty)
    # (kind, namespace, name) -> the document that defined it first: applying both, the second
    # would silently replace the first.
    defined: dict[tuple[str, str | None, str], str] = {}
    for path in files:
        try:
            documents = read_documents(path)
        except ManifestUnreadable as exc:
            print(exc, file=sys.stderr)
            usage_error = True
            continue
        if not documents:
            print(f"{path}: no documents", file=sys.stderr)
            usage_error = True
        for document in documents:
            try:
                resource = parse_document(document.data)
            except InvalidSpec as exc:
                invalid = True
                print("\n".join(_lines(document.label, exc.problems)))
                continue
            meta = resource.metadata
            key = (resource.kind, meta.namespace, meta.name)
            first = defined.setdefault(key, document.label)
            if first != document.label:
                invalid = True
                where = f"namespace {meta.namespace!r}" if meta.namespace else "no namespace"
                print(
                    f"{document.label}: metadata.name: {resource.kind} {meta.name!r} ({where}) is also"
                    f" defined by {first}"
                )
                continue
            problems = run_check(resource) if run_check is not None and isinstance(resource, RLRun) else []
            if problems:
                invalid = True
                print("\n".join(f"{document.label}: {problem}" for problem in problems))
                continue
            if not args.quiet:
                print(f"{document.label}: valid {resource.kind} {meta.name!r}")
    if usage_error:
        return 2
    return 1 if invalid else 0
