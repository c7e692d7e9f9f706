"""``mixrl validate FILE|DIR...``: one line per problem; exit 0 valid, 1 invalid, 2 usage error."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import ManifestUnreadable, parse_document, read_documents


def _expand(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        else:
            files.append(path)
    return files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mixrl validate", description=__doc__)
    parser.add_argument("paths", nargs="+", metavar="FILE", help="RLRun YAML files or directories of them")
    parser.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    args = parser.parse_args(argv)

    invalid = usage_error = False
    for path in _expand(args.paths):
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
                for problem in exc.problems:
                    print(f"{document.label}: {problem}")
                continue
            if not args.quiet:
                print(f"{document.label}: valid {resource.kind} {resource.metadata.name!r}")
    if usage_error:
        return 2
    return 1 if invalid else 0
