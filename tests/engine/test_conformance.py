"""The conformance table of docs/engine.md against SGLang's own classes and a real server.

Three checks, so the table cannot drift from either side:

1. the engine's field tables (``protocol.GENERATE_FIELDS``, ``SAMPLING_FIELDS``,
   ``openai_api.COMPLETION_FIELDS``, ``CHAT_FIELDS``) list every field of SGLang's
   ``GenerateReqInput``, ``SamplingParams``, ``CompletionRequest`` and ``ChatCompletionRequest``,
   read from the pinned SGLang package that scripts/setup.sh installs (tests/sglang/conftest.py;
   the test fails, never skips, without it);
2. docs/engine.md's tables say, row by row, what those tables say;
3. every row is walked against the engine's HTTP app on loopback with a real tokenizer: a refused
   field sent with a value that asks for it gets 400 naming it, a not-applicable one gets 200, every
   served endpoint answers and every route the page lists as not served is 404.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mixrl.api.resolve import SGLANG_VERSION
from mixrl.rl.engine.openai_api import CHAT_FIELDS, COMPLETION_FIELDS
from mixrl.rl.engine.protocol import GENERATE_FIELDS, SAMPLING_FIELDS, FieldRule

from .conftest import serve_in_process

DOC = Path(__file__).parents[2] / "docs" / "engine.md"
TABLES: dict[str, tuple[dict[str, FieldRule], str, str]] = {
    # doc table title: (field table, SGLang file, SGLang class)
    "`/generate` field": (GENERATE_FIELDS, "sglang/srt/managers/io_struct.py", "GenerateReqInput"),
    "`sampling_params` field": (SAMPLING_FIELDS, "sglang/srt/sampling/sampling_params.py", "SamplingParams"),
    "`/v1/completions` field": (
        COMPLETION_FIELDS,
        "sglang/srt/entrypoints/openai/protocol.py",
        "CompletionRequest",
    ),
    "`/v1/chat/completions` field": (
        CHAT_FIELDS,
        "sglang/srt/entrypoints/openai/protocol.py",
        "ChatCompletionRequest",
    ),
}
STATUS = {"honoured": "honoured", "refused (400)": "refused", "not applicable": "not applicable"}


def sglang_env_dir() -> Path:
    """Where scripts/setup.sh put the pinned SGLang (as tests/sglang/conftest.py finds it)."""
    default = Path.home() / ".cache" / "mixrl" / f"sglang-{SGLANG_VERSION}"
    return Path(os.environ.get("MIXRL_SGLANG_ENV") or default)


def sglang_fields(relative: str, cls: str) -> list[str]:
    """The annotated fields of ``cls`` in the installed SGLang package (its private ones left out)."""
    path = sglang_env_dir() / relative
    assert path.is_file(), f"the pinned SGLang package is missing {path}; run scripts/setup.sh"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and not s.target.id.startswith("_")
            ]
    raise AssertionError(f"{cls} not found in {path}")


def doc_tables() -> dict[str, dict[str, tuple[str, str]]]:
    """docs/engine.md's tables by their first header cell: ``{field: (status, why)}``."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current: dict[str, tuple[str, str]] | None = None
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            current = None
        elif cells[0] in TABLES or cells[0] == "endpoint":
            current = tables.setdefault(cells[0], {})
        elif current is not None and not set(cells[0]) <= {"-"}:
            for name in re.findall(r"`([^`]+)`", cells[0]):
                current[name] = (cells[1], cells[2] if len(cells) > 2 else "")
    return tables


@pytest.mark.parametrize("title", list(TABLES))
def test_every_sglang_field_is_classified_and_the_page_says_so(title: str) -> None:
    table, relative, cls = TABLES[title]
    theirs = sglang_fields(relative, cls)
    assert sorted(set(theirs) - set(table)) == [], f"SGLang's {cls} fields the engine does not classify"
    assert sorted(set(table) - set(theirs)) == [], f"fields classified for {cls} that SGLang does not have"
    documented = doc_tables()[title]
    assert sorted(documented) == sorted(table), f"docs/engine.md's {title} table lists other fields"
    for name, rule in table.items():
        status, why = documented[name]
        assert STATUS[status] == rule.status, f"{name}: the page says {status}, the code {rule.status}"
        assert why == rule.why, f"{name}: the page's reason differs from the code's"


def _body(path: str, name: str, value: Any) -> dict[str, Any]:
    """A valid request for ``path`` with ``name`` set to ``value``."""
    if path == "/generate":
        return {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}, name: value}
    if path == "/generate#sampling":
        return {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1, name: value}}
    if path == "/v1/completions":
        return {"model": "m", "prompt": "w010 w011", "max_tokens": 1, name: value}
    return {"model": "m", "messages": [{"role": "user", "content": "w010"}], "max_tokens": 1, name: value}


WALKS = [
    ("/generate", GENERATE_FIELDS, ""),
    ("/generate#sampling", SAMPLING_FIELDS, "sampling_params."),
    ("/v1/completions", COMPLETION_FIELDS, ""),
    ("/v1/chat/completions", CHAT_FIELDS, ""),
]


@pytest.mark.asyncio
async def test_every_row_holds_against_the_server(dense_path: str, tokenizer_dir: str) -> None:
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _),
        aiohttp.ClientSession() as session,
    ):
        checked = 0
        for path, table, prefix in WALKS:
            route = path.split("#")[0]
            for name, rule in table.items():
                if rule.status == "honoured":
                    continue
                value = rule.example if rule.status == "refused" else "x"
                async with session.post(f"{url}{route}", json=_body(path, name, value)) as response:
                    answer = await response.json()
                if rule.status == "refused":
                    assert response.status == 400, f"{route} {prefix}{name}={value!r}: {response.status}"
                    assert answer["error"]["param"] == f"{prefix}{name}", answer
                    assert rule.why in answer["error"]["message"]
                else:
                    assert response.status == 200, f"{route} {prefix}{name}: {response.status} {answer}"
                checked += 1
        assert checked > 150
        endpoints = doc_tables()["endpoint"]
        for route, (status, _) in endpoints.items():
            method = "POST" if route in POST_ROUTES else "GET"
            async with session.request(method, f"{url}{route}", json=SAFE_BODIES.get(route, {})) as response:
                if status == "honoured":
                    assert response.status != 404, route
                else:
                    assert response.status == 404, route
                    async with session.post(f"{url}{route}", json={}) as posted:
                        assert posted.status == 404, route


POST_ROUTES = {
    "/generate",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/v1/completions",
    "/v1/chat/completions",
}
SAFE_BODIES: dict[str, Any] = {
    # bodies that leave the engine as it was: refused or no-op requests are enough to show a route
    "/generate": {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
    "/update_weights_from_disk": {"model_path": "relative"},
    "/update_weight_version": {"new_version": 0, "abort_all_requests": False},
    "/pause_generation": {"mode": "in_place"},
    "/abort_request": {"rid": "nobody"},
    "/v1/completions": {"model": "m", "prompt": "w010", "max_tokens": 1},
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "w010"}],
        "max_tokens": 1,
    },
}
