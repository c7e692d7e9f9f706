"""The model's tokenizer for the torch engine: text in and out, stop strings, chat templates.

SGLang loads the tokenizer from ``--tokenizer-path`` (default: the model path) unless
``--skip-tokenizer-init``; the torch engine does the same, with one difference: when the path was
defaulted and holds no Hugging Face tokenizer, the engine runs token-in/token-out and every request
field that needs text is refused naming why (protocol.NO_TOKENIZER).  A version the weight store
publishes carries the Hugging Face tokenizer files of the run's model beside its weights
(``mixrl.rl.weights.tokenizer_files``), so an engine started from one has its tokenizer; a
``tiny:`` model's versions carry none, and a directory holding mixrl's word tokenizer (its
``tokenizer.json`` is not Hugging Face's) counts as none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mixrl.rl.engine.protocol import RequestError, clip

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
STOP_WINDOW_SLACK = 4
"""Tokens decoded beyond the longest stop string's length when looking for it in the tail."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or does not fit the model."""


class HFTextCodec:
    """A Hugging Face tokenizer as the wire format's ``TextCodec``."""

    def __init__(self, hf: Any, path: str) -> None:
        self.hf = hf
        self.path = path

    @property
    def size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True, spaces: bool = True) -> str:
        return str(
            self.hf.decode(
                list(ids), skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces
            )
        )

    def token_text(self, token_id: int) -> str:
        return str(self.hf.decode([token_id]))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def chat_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt the chat template renders for ``messages``, with the generation prompt.

        A template that refuses the conversation (real ones call ``raise_exception`` on an unknown
        role or roles out of order) is the client's error: a RequestError naming ``messages`` with
        the template's reason, not an HTTP 500.  A template that does not parse stays the server's."""
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        try:
            rendered = self.hf.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=True
            )
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise RequestError("messages", f"the chat template refuses them: {exc}") from None
        return list(rendered["input_ids"])

    def stop_check(
        self, stops: Sequence[str], skip_special_tokens: bool
    ) -> Callable[[list[int]], str | None]:
        """A function of the output ids: the stop string their decoded tail contains, if any.

        Called after every token, so the first completed stop string is found when its last token
        arrives; only a tail of ``len(longest stop) + STOP_WINDOW_SLACK`` tokens is decoded (every
        token decodes to at least one character except special tokens).
        """
        window = max(len(s) for s in stops) + STOP_WINDOW_SLACK

        def check(ids: list[int]) -> str | None:
            tail = self.decode(ids[-window:], skip_special_tokens=skip_special_tokens)
            for stop in stops:
                if stop in tail:
                    return stop
            return None

        return check


def _is_mixrl_word_tokenizer(path: Path) -> bool:
    try:
        with (path / "tokenizer.json").open(encoding="utf-8") as file:
            head = json.loads(file.read()).get("format", "")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(head, str) and head.startswith("mixrl")


def load_codec(
    model_path: str, tokenizer_path: str | None, skip_tokenizer_init: bool, vocab_size: int
) -> HFTextCodec | None:
    """The engine's tokenizer, or None (token-in/token-out).

    An explicit ``tokenizer_path`` that cannot be loaded, or any tokenizer with more ids than the
    model's vocabulary, is a :class:`TokenizerError`; a defaulted path without tokenizer files (or
    with mixrl's word tokenizer) means no tokenizer, logged once.
    """
    if skip_tokenizer_init:
        return None
    path = Path(tokenizer_path or model_path)
    if tokenizer_path is None:
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            log.info("no tokenizer files at %s: token-in/token-out (text requests are refused)", path)
            return None
        if _is_mixrl_word_tokenizer(path):
            log.info("%s holds mixrl's word tokenizer, not a Hugging Face one: token-in/token-out", path)
            return None
    from transformers import AutoTokenizer

    where = f"--tokenizer-path {path}" if tokenizer_path else f"--model-path {path} (its tokenizer files)"
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"{where}: cannot load a tokenizer ({clip(' '.join(str(exc).split()), 300)}); "
            "pass --tokenizer-path or --skip-tokenizer-init"
        ) from None
    if len(hf) > vocab_size:
        raise TokenizerError(f"{where}: the tokenizer has {len(hf)} ids, the model's vocabulary {vocab_size}")
    return HFTextCodec(hf, str(path))
