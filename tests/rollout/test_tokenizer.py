"""The word tokenizer: round trips, chat rendering, persistence, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixrl.rl.environments.filetree import (
    NO_SUCH_FILE,
    WORDS,
    Difficulty,
    FileTreeEnvironment,
    generate_tasks,
)
from mixrl.rl.rollout.tokenizer import SPECIAL_TOKENS, Tokenizer, split_words


def every_text() -> list[str]:
    tasks = generate_tasks(3, 40, "train", Difficulty(files=4, lines=3)) + generate_tasks(3, 10, "heldout")
    texts = [NO_SUCH_FILE, FileTreeEnvironment.no_tool_call.content]
    for task in tasks:
        texts += [task.question, task.answer, " ".join(task.files), *task.files.values()]
        texts += [f"cat {path}" for path in task.files] + [f"submit {task.answer}"]
    return texts


def test_vocabulary_is_fixed_and_closed() -> None:
    tokenizer = Tokenizer.filetree()
    assert tokenizer.tokens == (*SPECIAL_TOKENS, *WORDS)
    assert tokenizer.vocab_size == len(SPECIAL_TOKENS) + len(WORDS) == 159
    assert tokenizer.pad_id == 0  # the tiny models' pad_token_id
    for text in every_text():
        assert tokenizer.unk_id not in tokenizer.encode(text), text


@pytest.mark.parametrize("text", every_text()[:60])
def test_text_round_trips(text: str) -> None:
    tokenizer = Tokenizer.filetree()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(tokenizer.decode(ids)) == ids


def test_words_split_file_names_and_lines() -> None:
    assert split_words("cat net.cfg") == ["cat", "net", ".cfg"]
    assert split_words("port 42\nhost 7") == ["port", "42", "\n", "host", "7"]
    assert split_words("<|tool|>ls<|end|>") == ["<|tool|>", "ls", "<|end|>"]


def test_unknown_words_become_unk_and_ids_outside_fail() -> None:
    tokenizer = Tokenizer.filetree()
    assert tokenizer.encode("cat passwd 123") == [
        tokenizer.token_id("cat"),
        tokenizer.unk_id,
        tokenizer.unk_id,
    ]
    with pytest.raises(ValueError, match="ids: token id 159 is outside the vocabulary of 159"):
        tokenizer.decode([159])


def test_chat_rendering_is_token_level() -> None:
    tokenizer = Tokenizer.filetree()
    prompt = tokenizer.prompt_ids("what is port in net ?")
    assert tokenizer.decode(prompt) == "<bos> <|user|> what is port in net ? <|end|> <|assistant|>"
    observation = tokenizer.observation_ids("tool", "port 42")
    assert observation == [*tokenizer.render("tool", "port 42"), tokenizer.role_ids["assistant"]]
    assert tokenizer.decode(observation) == "<|tool|> port 42 <|end|> <|assistant|>"
    # rendering a turn never depends on what came before it: concatenation is the whole transcript
    transcript = prompt + tokenizer.encode("ls") + [tokenizer.end_id] + observation
    assert transcript[: len(prompt)] == prompt and transcript[-len(observation) :] == observation
    assert tokenizer.reply_text([*tokenizer.encode("cat net.cfg"), tokenizer.end_id]) == "cat net.cfg"
    with pytest.raises(ValueError, match="role: expected one of user, assistant, tool, got 'system'"):
        tokenizer.render("system", "hi")  # type: ignore[arg-type]


def test_save_and_load(tmp_path: Path) -> None:
    tokenizer = Tokenizer.filetree()
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    assert loaded == tokenizer and loaded.encode("ls") == tokenizer.encode("ls")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "tokenizer: no such file"),
        ("{", "is not JSON"),
        ('{"format": "other"}', "is not a mixrl-word-tokenizer file"),
        ('{"format": "mixrl-word-tokenizer", "version": 9, "tokens": []}', "has version 9, expected 1"),
        ('{"format": "mixrl-word-tokenizer", "version": 1, "tokens": [1]}', "field tokens must be a list"),
        ('{"format": "mixrl-word-tokenizer", "version": 1, "tokens": ["a"]}', "missing special tokens"),
    ],
)
def test_bad_tokenizer_files_get_one_line(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        Tokenizer.load(path)
