"""``mixrl crds [--out DIR] [--check]``: write the CRDs from the models, or check they are current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixrl.api.crd import crd_files
from mixrl.api.plain_text import plain_text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mixrl crds", description=plain_text(__doc__))
    parser.add_argument("--out", default="crds", help="directory for the CRD files (default: crds)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from the models")
    args = parser.parse_args(argv)
    out = Path(args.out)
    stale = []
    for name, text in crd_files().items():
        path = out / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(f"{path}: {'missing' if current is None else 'differs from the models'}")
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for line in stale:
        print(line, file=sys.stderr)
    if stale:
        print("run `mixrl crds` to regenerate", file=sys.stderr)
        return 1
    return 0
