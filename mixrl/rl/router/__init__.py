"""Session router: assigns agent sessions to sampler pools by capacity and proxies their requests.

``mixrl router`` runs :func:`main`; the pieces are :mod:`.shares` (pure share scheduling),
:mod:`.state` (pure bookkeeping), :mod:`.config`, :mod:`.server` (aiohttp) and :mod:`.exporter`.
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from mixrl.rl.router.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
