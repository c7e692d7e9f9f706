"""The real ``openai`` Python client against the torch engine's OpenAI-compatible ``/v1``.

Real: the engine's HTTP app on loopback (``serve_in_process``) with a tiny Qwen3 and a real Hugging
Face tokenizer loaded from disk (``--tokenizer-path``); the official ``openai`` package (its async
client and its error types) as the caller.  Answers are checked against the engine's own
``/generate`` for the same prompt and against the tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from .conftest import serve_in_process, word

pytestmark = pytest.mark.asyncio

MODEL = "tiny-qwen3"
GREEDY_EXTRA = {"ignore_eos": True}


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def generate(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(f"{url}/generate", json=body) as response:
        assert response.status == 200
        return await response.json()


async def test_models_completions_and_logprobs(dense_path: str, tokenizer_dir: str) -> None:
    hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    prompt = " ".join(word(i) for i in (40, 41, 300))
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir, served_model_name=MODEL) as (
            url,
            _,
        ),
        client(url) as api,
    ):
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        done = await api.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            logprobs=3,
            extra_body={**GREEDY_EXTRA, "return_token_ids": True},
        )
        native = await generate(
            url,
            {
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                "return_logprob": True,
                "top_logprobs_num": 3,
            },
        )
        (choice,) = done.choices
        extra = choice.model_extra or {}
        assert extra["token_ids"] == native["output_ids"]
        assert extra["prompt_token_ids"] == hf.encode(prompt)
        assert choice.text == native["text"] == hf.decode(native["output_ids"], skip_special_tokens=True)
        assert choice.finish_reason == "length"
        assert (
            done.usage.prompt_tokens == 3
            and done.usage.completion_tokens == 6
            and done.usage.total_tokens == 9
        )
        lp = choice.logprobs
        assert lp.tokens == [hf.decode([t]) for t in native["output_ids"]]
        assert lp.token_logprobs == pytest.approx(
            [t[0] for t in native["meta_info"]["output_token_logprobs"]], abs=1e-5
        )
        assert all(len(top) == 3 for top in lp.top_logprobs)
        for top, native_top in zip(lp.top_logprobs, native["meta_info"]["output_top_logprobs"], strict=True):
            assert top == pytest.approx({hf.decode([c[1]]): c[0] for c in native_top}, abs=1e-5)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

        many = await api.completions.create(
            model=MODEL, prompt=[prompt, word(77)], max_tokens=3, n=2, seed=5, extra_body=GREEDY_EXTRA
        )
        assert [c.index for c in many.choices] == [0, 1, 2, 3]
        assert many.usage.prompt_tokens == 3 + 1 and many.usage.completion_tokens == 12
        ids_prompt = await api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0)
        assert ids_prompt.usage.prompt_tokens == 3


async def test_chat_completions_render_the_template_and_return_ids(
    dense_path: str, tokenizer_dir: str
) -> None:
    hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    messages = [
        {"role": "system", "content": word(20)},
        {"role": "user", "content": f"{word(40)} {word(41)}"},
    ]
    rendered = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir, served_model_name=MODEL) as (
            url,
            _,
        ),
        client(url) as api,
    ):
        chat = await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={**GREEDY_EXTRA, "return_token_ids": True},
        )
        (choice,) = chat.choices
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == rendered["input_ids"]
        native = await generate(
            url,
            {
                "input_ids": rendered["input_ids"],
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            },
        )
        assert extra["response_token_ids"] == native["output_ids"]
        assert choice.message.role == "assistant" and choice.message.content == native["text"]
        content = choice.logprobs.content
        assert [c.token for c in content] == [hf.decode([t]) for t in native["output_ids"]]
        assert [c.logprob for c in content] == pytest.approx(
            [t[0] for t in native["meta_info"]["output_token_logprobs"]], abs=1e-5
        )
        assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
        stop = hf.decode([native["output_ids"][0]])
        stopped = await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stop=[stop],
            extra_body=GREEDY_EXTRA,
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stop not in stopped.choices[0].message.content


async def test_fields_the_engine_cannot_honour_are_refused_by_name(
    dense_path: str, tokenizer_dir: str
) -> None:
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _),
        client(url) as api,
    ):
        chat = [{"role": "user", "content": "w040"}]
        calls = (
            (
                lambda: api.completions.create(model=MODEL, prompt="w040", logit_bias={"9": 2.0}),
                "logit_bias",
            ),
            (lambda: api.completions.create(model=MODEL, prompt="w040", echo=True), "echo"),
            (
                lambda: api.completions.create(
                    model=MODEL, prompt="w040", stream=True, stream_options={"continuous_usage_stats": True}
                ),
                "stream_options.continuous_usage_stats",
            ),
            (
                lambda: api.chat.completions.create(
                    model=MODEL, messages=chat, tools=[{"type": "function", "function": {"name": "f"}}]
                ),
                "tools",
            ),
            (
                lambda: api.chat.completions.create(
                    model=MODEL, messages=chat, response_format={"type": "json_object"}
                ),
                "response_format",
            ),
        )
        for call, field in calls:
            with pytest.raises(openai.BadRequestError) as refused:
                await call()
            assert refused.value.status_code == 400
            assert refused.value.param == field, refused.value.message
    async with serve_in_process(model_path=dense_path) as (url, _):  # no tokenizer
        async with client(url) as api:
            with pytest.raises(openai.BadRequestError) as refused:
                await api.completions.create(model=MODEL, prompt="w040")
        assert refused.value.param == "prompt" and "tokenizer" in refused.value.message


async def test_a_lone_surrogate_in_text_is_a_400_naming_the_field(
    dense_path: str, tokenizer_dir: str
) -> None:
    """JSON's ``"\\ud800"`` decodes to a string no tokenizer can encode: before, an HTTP 500 with
    a traceback (before the token check, so even without the run's token)."""
    sampling = '"sampling_params": {"max_new_tokens": 1}'
    bodies = (
        ("/generate", '{"text": "w040 \\ud800", ' + sampling + "}", "text"),
        ("/generate", '{"text": ["w040", "\\udcff"], ' + sampling + "}", "text[1]"),
        ("/v1/completions", '{"model": "m", "prompt": "\\ud800", "max_tokens": 1}', "prompt"),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "a\\udfff"}]}',
         "messages[0].content"),
    )  # fmt: skip
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _),
        aiohttp.ClientSession() as session,
    ):
        for path, body, field in bodies:
            async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as response:  # fmt: skip
                answer = await response.json(content_type=None)
            assert response.status == 400, (path, answer)
            message = answer["error"]["message"]
            assert message.startswith(f"{field}: holds a lone surrogate"), message
            assert "Traceback" not in message


async def test_streams_are_openai_chunks_that_add_up_to_the_whole_answer(
    dense_path: str, tokenizer_dir: str
) -> None:
    prompt = " ".join(word(i) for i in (40, 41, 300))
    messages = [{"role": "user", "content": prompt}]
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": GREEDY_EXTRA}
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _),
        client(url) as api,
    ):
        whole = await api.completions.create(prompt=prompt, logprobs=2, **greedy)
        chunks = [
            c
            async for c in await api.completions.create(
                prompt=prompt, logprobs=2, stream=True, stream_options={"include_usage": True}, **greedy
            )
        ]
        *parts, usage = chunks
        assert usage.choices == [] and usage.usage.completion_tokens == 6 and usage.usage.prompt_tokens == 3
        assert len(parts) == 6  # one chunk per generated token
        assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in parts] == [None] * 5 + ["length"]
        streamed = [lp for c in parts for lp in c.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)

        chat = await api.chat.completions.create(messages=messages, **greedy)
        deltas = [
            c async for c in await api.chat.completions.create(messages=messages, stream=True, **greedy)
        ]
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in deltas) == chat.choices[0].message.content
        assert deltas[-1].choices[0].finish_reason == "length"
        assert all(c.object == "chat.completion.chunk" for c in deltas)


async def test_a_streamed_stop_string_spanning_tokens_is_held_back_and_cut(
    dense_path: str, tokenizer_dir: str
) -> None:
    """The stream's deltas add up to the non-streamed text also when a stop string spans tokens:
    its first characters are held back, not sent and left uncut (as they were before)."""
    prompt = " ".join(word(i) for i in (40, 41, 300))
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": GREEDY_EXTRA}
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _),
        client(url) as api,
    ):
        free = (await api.completions.create(prompt=prompt, **greedy)).choices[0].text
        words = free.split(" ")
        assert len(words) == 6, free
        # the end of the third word, the space and the start of the fourth: two tokens
        stop = f"{words[2][-2:]} {words[3][:3]}"
        whole = await api.completions.create(prompt=prompt, stop=stop, **greedy)
        choice = whole.choices[0]
        assert choice.finish_reason == "stop" and choice.matched_stop == stop
        assert stop not in choice.text and free.startswith(choice.text + stop)
        parts = [
            c async for c in await api.completions.create(prompt=prompt, stop=stop, stream=True, **greedy)
        ]
        texts = [c.choices[0].text for c in parts]
        assert "".join(texts) == choice.text
        # everything before the stop went out before the token that completed it, and nothing of
        # the stop's start (the third word's end) did
        assert "".join(texts[:-1]) == choice.text and texts[-1] == "", texts

        chat_args = {"messages": [{"role": "user", "content": prompt}], **greedy}
        chat_free = (await api.chat.completions.create(**chat_args)).choices[0].message.content
        chat_words = chat_free.split(" ")
        chat_stop = f"{chat_words[1][-2:]} {chat_words[2][:3]}"
        chat = await api.chat.completions.create(stop=chat_stop, **chat_args)
        deltas = [
            c async for c in await api.chat.completions.create(stop=chat_stop, stream=True, **chat_args)
        ]
        assert chat.choices[0].finish_reason == "stop"
        assert "".join(c.choices[0].delta.content or "" for c in deltas) == chat.choices[0].message.content


STRICT_CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('Only user, assistant and system roles are supported!') }}"
    "{%- endif %}"
    "<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
"""A template that refuses a conversation, as real ones do (Llama 2, Mistral and Gemma call
``raise_exception`` on an unknown role or roles out of order)."""


async def test_a_conversation_the_chat_template_refuses_is_a_400_naming_messages(
    dense_path: str, tokenizer_dir: str, tmp_path: Path
) -> None:
    """Before, the template's exception escaped the handler: HTTP 500, and nothing told the client
    which field was wrong.  The engine keeps serving."""
    strict = tmp_path / "strict-tokenizer"
    shutil.copytree(tokenizer_dir, strict)
    hf = AutoTokenizer.from_pretrained(str(strict), local_files_only=True)
    hf.chat_template = STRICT_CHAT_TEMPLATE
    hf.save_pretrained(str(strict))
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=str(strict)) as (url, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"messages": [{"role": "tool", "content": "w040"}], "max_tokens": 1}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            answer = await response.json(content_type=None)
        assert response.status == 400, answer
        assert answer["error"]["param"] == "messages"
        message = answer["error"]["message"]
        assert message == (
            "messages: the chat template refuses them: Only user, assistant and system roles are supported!"
        )
        body = {"messages": [{"role": "user", "content": "w040"}], "max_tokens": 1}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
