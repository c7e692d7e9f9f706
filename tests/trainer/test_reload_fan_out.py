"""``mixrl run``'s reload fan-out through the router, after a version is published: a router that is
unreachable or answers something that is not JSON costs one warning, never the trainer (it used to
end the process between publishing and committing); a refused token stays fatal."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from mixrl.rl.trainer.main import ReloadRefused, TrainerLoop
from mixrl.rl.weights import WeightStore

from ..fakes import serve


def _loop(tmp_path: Path, router_url: str) -> TrainerLoop:
    """Only what `reload_engines` reads of a trainer loop."""
    stub = SimpleNamespace(router_url=router_url, store=WeightStore(str(tmp_path / "w")), auth_headers={})
    return stub  # type: ignore[return-value]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_router_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with caplog.at_level("WARNING", logger="mixrl.trainer"):
        await TrainerLoop.reload_engines(_loop(tmp_path, url), 3)
    (record,) = caplog.records
    assert record.getMessage().startswith(f"engine reload to version 3: router {url}: ClientConnectorError")


async def test_a_router_answering_html_is_a_warning_and_a_refused_token_is_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    statuses = [502, 401]

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=statuses.pop(0), text="<html>Bad Gateway</html>", content_type="text/html")

    app = web.Application()
    app.router.add_post("/update_weights_from_disk", answer)
    runner, url = await serve(app)
    try:
        with caplog.at_level("WARNING", logger="mixrl.trainer"):
            await TrainerLoop.reload_engines(_loop(tmp_path, url), 4)
        (record,) = caplog.records
        assert record.getMessage() == "engine reload to version 4: HTTP 502 <html>Bad Gateway</html>"
        with pytest.raises(ReloadRefused, match=r"^POST /update_weights_from_disk: 401: <html>Bad Gateway"):
            await TrainerLoop.reload_engines(_loop(tmp_path, url), 5)
    finally:
        await runner.cleanup()
