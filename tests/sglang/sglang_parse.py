"""Run inside SGLang's test-only environment: parse command lines with SGLang's own argument parser.

Reads ``{"lines": [[arg, ...], ...]}`` on stdin and writes ``{"version": ..., "results": [...]}``
to the file named by its argument (SGLang may log on stdout), where each result is ``null`` (accepted) or SGLang's own error message.  Only
``ServerArgs.add_cli_args`` on an argparse parser, exactly what ``sglang.launch_server`` builds
before it looks for an accelerator, so it runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys


class Refused(Exception):
    pass


class ParserThatRaises(argparse.ArgumentParser):
    # argparse exits on unknown arguments and bad choices even with exit_on_error=False (3.11).
    def error(self, message: str) -> None:  # type: ignore[override]
        raise Refused(message)


def refusal(line: list[str]) -> str | None:
    from sglang.srt.server_args import ServerArgs

    parser = ParserThatRaises(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    try:
        parser.parse_args(line)
    except Refused as exc:
        return str(exc)
    return None


def main() -> None:
    import sglang

    lines = json.load(sys.stdin)["lines"]
    results = [refusal(line) for line in lines]
    with open(sys.argv[1], "w") as out:
        json.dump({"version": sglang.__version__, "results": results}, out)


if __name__ == "__main__":
    main()
