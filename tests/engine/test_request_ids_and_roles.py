"""Request ids and chat roles as SGLang checks them, and through the torch engine's HTTP server.

Pure: :mod:`mixrl.rl.engine.openai_api` and :mod:`mixrl.rl.engine.protocol` parsing requests, with a
stand-in tokenizer (one id per UTF-8 byte; its chat template records the messages it was given).
Real: the engine's HTTP app on loopback (``serve_in_process``, a tiny Qwen3) holding a request in
flight with ``pause_generation`` while another asks for its id.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from mixrl.rl.engine import openai_api
from mixrl.rl.engine.protocol import RequestError, parse_generate

from .conftest import ByteCodec, serve_in_process


class RecordingChatCodec(ByteCodec):
    """A byte-level tokenizer with a chat template that records the messages it renders."""

    has_chat_template = True

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, Any]]] = []

    def chat_ids(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        self.rendered.append(messages)
        return self.encode("".join(m["content"] for m in messages))


def chat(messages: list[dict[str, Any]], codec: RecordingChatCodec | None = None) -> openai_api.OpenAIRequest:
    return openai_api.parse_chat(
        {"messages": messages},
        vocab_size=256,
        context_length=1024,
        defaults={},
        codec=codec or RecordingChatCodec(),
    )


def completion(body: dict[str, Any]) -> openai_api.OpenAIRequest:
    return openai_api.parse_completion(
        {"max_tokens": 1, **body},
        vocab_size=256,
        context_length=1024,
        defaults={},
        codec=RecordingChatCodec(),
    )


def refusal(call: Any) -> str:
    with pytest.raises(RequestError) as caught:
        call()
    return str(caught.value)


# ------------------------------------------------------------------------------------ chat roles


@pytest.mark.parametrize("role", ["bogus", "User", "", "assistant ", "model"])
def test_a_role_sglang_refuses_is_a_400_naming_it(role: str) -> None:
    """Before, any role went to the chat template, which rendered "bogus" as if it meant something."""
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    with pytest.raises(RequestError) as caught:
        chat(messages)
    assert caught.value.field == "messages[1].role"
    assert str(caught.value) == (
        "messages[1].role: must be one of 'user', 'system', 'assistant', 'tool', 'function', 'developer', "
        f"'latest_reminder', 'root', got {role!r}"
    )


def test_the_roles_sglang_accepts_reach_the_template_lowercased_as_it_sends_them() -> None:
    codec = RecordingChatCodec()
    roles = ["system", "Developer", "user", "ASSISTANT", "tool", "function", "latest_reminder", "root"]
    chat([{"role": role, "content": "x"} for role in roles], codec)
    assert [m["role"] for m in codec.rendered[0]] == [r.lower() for r in roles]


# ------------------------------------------------------------------------------------ request ids


def test_completions_take_a_list_rid_with_one_id_per_prompt() -> None:
    """Before, a list ``rid`` was refused although SGLang takes one for a batch of prompts."""
    parsed = completion({"prompt": ["a", "b"], "rid": ["x", "y"]})
    assert [item.rid for item in parsed.items] == ["x", "y"]
    parsed = completion({"prompt": ["a", "b"], "rid": ["x", "y"], "n": 2})
    assert [item.rid for item in parsed.items] == ["x_0", "x_1", "y_0", "y_1"]
    parsed = completion({"prompt": ["a", "b"], "rid": "z", "n": 2})  # a string: as before
    assert [item.rid for item in parsed.items] == ["z_0", "z_1", "z_2", "z_3"]
    assert (
        refusal(lambda: completion({"prompt": ["a", "b"], "rid": ["x"]}))
        == "rid: has 1 entries for 2 prompts"
    )
    assert refusal(lambda: completion({"prompt": ["a"], "rid": [7]})) == "rid[0]: must be a string"
    assert refusal(lambda: completion({"prompt": ["a", "b"], "rid": ["x", "x"]})) == (
        "rid: repeats 'x'; every item needs its own id"
    )
    # A chat is one conversation: its rid stays a string.
    with pytest.raises(RequestError, match=r"^rid: must be a string$"):
        openai_api.parse_chat(
            {"messages": [{"role": "user", "content": "a"}], "rid": ["x"]},
            vocab_size=256,
            context_length=1024,
            defaults={},
            codec=RecordingChatCodec(),
        )


def test_a_generate_batch_that_repeats_a_rid_is_a_400_naming_rid() -> None:
    """Before, both items ran under one id, and /abort_request for it aborted both."""
    body = {"input_ids": [[1], [2], [3]], "rid": ["a", "b", "a"]}
    with pytest.raises(RequestError) as caught:
        parse_generate(body, vocab_size=16, context_length=64)
    assert (caught.value.field, str(caught.value)) == ("rid", "rid: repeats 'a'; every item needs its own id")
    items, _ = parse_generate({**body, "rid": ["a", "b", "c"]}, vocab_size=16, context_length=64)
    assert [item.rid for item in items] == ["a", "b", "c"]


@pytest.mark.asyncio
async def test_a_rid_already_in_flight_is_a_400_naming_rid_and_free_again_once_it_ends(
    dense_path: str, tokenizer_dir: str
) -> None:
    """Before, a second request could take the id of one still running; /abort_request for that id
    then aborted both."""
    held: dict[str, Any] = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "rid": "held"}
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, service),
        aiohttp.ClientSession() as session,
    ):

        async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            async with session.post(url + path, json=body) as response:
                return response.status, await response.json(content_type=None)

        assert (await post("/pause_generation", {"mode": "in_place"}))[0] == 200
        first = asyncio.create_task(post("/generate", held))
        while service.sched.num_waiting < 1:
            await asyncio.sleep(0.01)
        again: list[tuple[str, dict[str, Any]]] = [
            ("/generate", held),
            ("/generate", {**held, "stream": True}),
            ("/generate", {"input_ids": [[1], [2]], "rid": ["other", "held"]}),
            ("/v1/completions", {"prompt": "w040", "max_tokens": 1, "rid": "held"}),
            ("/v1/completions", {"prompt": ["w040", "w041"], "max_tokens": 1, "rid": ["held", "x"]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w040"}], "rid": "held"}),
        ]
        for path, body in again:
            status, answer = await post(path, body)
            assert status == 400, (path, body, answer)
            assert answer["error"]["param"] == "rid"
            assert (
                answer["error"]["message"] == "rid: 'held' already in flight; every request needs its own id"
            )
        assert (await post("/abort_request", {"rid": "other"}))[1] == {"success": True, "aborted": 0}
        assert (await post("/continue_generation", {}))[0] == 200
        status, answer = await first
        assert status == 200 and answer["meta_info"]["id"] == "held"
        status, answer = await post("/generate", held)  # ended: the id is free again
        assert status == 200 and answer["meta_info"]["id"] == "held"
        status, answer = await post(
            "/v1/completions", {"prompt": ["w040", "w041"], "max_tokens": 1, "rid": ["p", "q"]}
        )
        assert status == 200, answer
