"""A local, deterministic word-level tokenizer over an environment's closed vocabulary.

Nothing is downloaded or trained: the vocabulary is the special tokens followed by the
environment's words (:meth:`mixrl.rl.environments.base.Environment.vocabulary`; filetree's are
:data:`mixrl.rl.environments.filetree.WORDS`), in a fixed order, so token ids never change between runs.

Text is split into words (runs of letters, numbers, file extensions such as ``.cfg``, newlines,
single punctuation marks); ``decode`` joins them with single spaces, attaching extensions to the
word before them and newlines without spaces, so canonical text round-trips:
``decode(encode(text)) == text``.

Chat rendering is token-level.  A turn is ``<|role|> words <|end|>``; the prompt is
``<bos>`` + the user turn + ``<|assistant|>`` (the generation prompt).  The model's reply ends
with ``<|end|>`` (the engine's stop token); the environment's answer is appended as
``<|tool|> output <|end|> <|assistant|>``.  Each piece is encoded once, when it is appended, and
earlier turns are never re-tokenized.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mixrl.rl.environments.base import Message
from mixrl.rl.environments.filetree import WORDS

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
USER, ASSISTANT, TOOL, END = "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, USER, ASSISTANT, TOOL, END)
ROLE_MARKERS: dict[str, str] = {"user": USER, "assistant": ASSISTANT, "tool": TOOL}

FORMAT = "mixrl-word-tokenizer"
FORMAT_VERSION = 1

_WORD = re.compile(r"<\|[a-z]+\|>|<[a-z]+>|\n|\.[a-z]+|[a-z_]+|\d+|\S", re.IGNORECASE)


def split_words(text: str) -> list[str]:
    return _WORD.findall(text)


def join_words(words: Iterable[str]) -> str:
    out: list[str] = []
    previous = ""
    for word in words:
        attaches = (
            word == "\n" or previous == "\n" or (len(word) > 1 and word.startswith(".") and bool(previous))
        )
        if out and not attaches:
            out.append(" ")
        out.append(word)
        previous = word
    return "".join(out)


class Tokenizer:
    """Word-level tokenizer: ``encode``, ``decode``, chat rendering, JSON save/load."""

    def __init__(self, tokens: Sequence[str]) -> None:
        missing = [special for special in SPECIAL_TOKENS if special not in tokens]
        if missing:
            raise ValueError(f"tokens: missing special tokens {missing}")
        if len(set(tokens)) != len(tokens):
            raise ValueError("tokens: duplicate entries")
        self.tokens: tuple[str, ...] = tuple(tokens)
        self._ids: dict[str, int] = {token: i for i, token in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (self._ids[t] for t in (PAD, BOS, EOS, UNK))
        self.end_id = self._ids[END]
        self.role_ids: dict[str, int] = {role: self._ids[marker] for role, marker in ROLE_MARKERS.items()}

    @classmethod
    def from_words(cls, words: Iterable[str]) -> Tokenizer:
        """The special tokens, then ``words`` (an environment's vocabulary) without repeats."""
        extra = [word for word in dict.fromkeys(words) if word not in SPECIAL_TOKENS]
        return cls([*SPECIAL_TOKENS, *extra])

    @classmethod
    def filetree(cls) -> Tokenizer:
        """The built-in tokenizer of the ``filetree`` task family."""
        return cls.from_words(WORDS)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end an assistant turn (what the engine is asked to stop on)."""
        return [self.end_id, self.eos_id]

    def token_id(self, token: str) -> int:
        return self._ids[token]

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(word, self.unk_id) for word in split_words(text)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        words = []
        for i in ids:
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"ids: token id {i} is outside the vocabulary of {len(self.tokens)}")
            token = self.tokens[i]
            if skip_special and token in SPECIAL_TOKENS:
                continue
            words.append(token)
        return join_words(words)

    # ------------------------------------------------------------------ chat rendering
    def render(self, role: str, text: str) -> list[int]:
        """One complete turn: ``<|role|> text <|end|>``."""
        if role not in self.role_ids:
            raise ValueError(f"role: expected one of {', '.join(self.role_ids)}, got {role!r}")
        return [self.role_ids[role], *self.encode(text), self.end_id]

    def generation_prompt(self) -> list[int]:
        """What precedes every assistant reply."""
        return [self.role_ids["assistant"]]

    def prompt_ids(self, question: str) -> list[int]:
        """The episode's first context: ``<bos> <|user|> question <|end|> <|assistant|>``."""
        return [self.bos_id, *self.render("user", question), *self.generation_prompt()]

    def chat_prompt_ids(self, messages: Sequence[Message], tools: Sequence[Any] = ()) -> list[int]:
        """An episode's first context from an environment's messages: ``<bos>``, each turn, and the
        generation prompt (one user message gives exactly :meth:`prompt_ids`).  ``tools`` are not
        rendered: a word-level model learns them from the task, not from a schema."""
        ids = [self.bos_id]
        for message in messages:
            if message.role not in self.role_ids:
                raise ValueError(
                    f"messages: the word tokenizer has no {message.role!r} role (it has {', '.join(self.role_ids)})"
                )
            ids += self.render(message.role, message.content)
        return [*ids, *self.generation_prompt()]

    def observation_ids(self, role: str, text: str, max_tokens: int | None = None) -> list[int]:
        """An environment turn followed by the next generation prompt (all loss-masked); the text's
        tokens are cut to ``max_tokens`` (rollout.maxObservationTokens)."""
        if role not in self.role_ids:
            raise ValueError(f"role: expected one of {', '.join(self.role_ids)}, got {role!r}")
        body = self.encode(text)[:max_tokens]
        return [self.role_ids[role], *body, self.end_id, *self.generation_prompt()]

    def reply_text(self, ids: Sequence[int]) -> str:
        """The text of a generated reply, without its stop token."""
        body = list(ids)
        if body and body[-1] in self.stop_token_ids:
            body.pop()
        return self.decode(body)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> str:
        return json.dumps(
            {"format": FORMAT, "version": FORMAT_VERSION, "tokens": list(self.tokens)}, indent=1
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"tokenizer: no such file {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"tokenizer: {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"tokenizer: {path} is not a {FORMAT} file")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"tokenizer: {path} has version {data.get('version')}, expected {FORMAT_VERSION}"
            )
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"tokenizer: {path} field tokens must be a list of strings")
        return cls(tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and self.tokens == other.tokens

    def __hash__(self) -> int:
        return hash(self.tokens)
