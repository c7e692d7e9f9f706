"""The model's own tokenizer and chat template, token-in-token-out (real models, in the cluster).

The agent loop needs five things of a tokenizer (:class:`ChatTokenizer`): the prompt's ids from the
environment's first messages (and its tools, for templates that render them), the ids of one
environment turn *appended to* a context that ends with the model's stop token, a reply's text,
the stop tokens, and the token that closes a reply cut short.  mixrl's word tokenizer
(:mod:`mixrl.rl.rollout.tokenizer`) has them for ``tiny:`` models; :class:`HFChatTokenizer` has them
for a Hugging Face tokenizer directory and its Jinja chat template (or ``model.chatTemplate``).

Appending a turn without re-tokenizing the context: the template renders a probe conversation
``[user, assistant]`` and the same conversation plus the new turn with the generation prompt; the
new turn's ids are what follows the probe's last end-of-turn token.  The first is checked to be a
token-level prefix of the second, so a template that rewrites earlier turns (or a tokenizer that
merges across the boundary) is refused with one line rather than silently mis-tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from mixrl.rl.environments.base import Message
from mixrl.rl.environments.tools import Tool
from mixrl.rl.rollout.tokenizer import FORMAT, Tokenizer

PROBE_USER, PROBE_REPLY = "probe question", "probe reply"


class ChatTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def end_id(self) -> int: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    def chat_prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]: ...
    def observation_ids(self, role: str, text: str, max_tokens: int | None = None) -> list[int]: ...
    def reply_text(self, ids: Sequence[int]) -> str: ...


class HFChatTokenizer:
    """A Hugging Face tokenizer with a chat template, as a :class:`ChatTokenizer`."""

    def __init__(self, hf: Any, chat_template: str | None = None, where: str = "model.tokenizer") -> None:
        if chat_template is not None:
            hf.chat_template = chat_template
        if not getattr(hf, "chat_template", None):
            raise ValueError(f"{where}: the tokenizer has no chat template; set model.chatTemplate")
        self.hf = hf
        self.where = where
        self._end_id = self._find_end_id()
        eos = hf.eos_token_id
        self._stop_ids = list(dict.fromkeys([self._end_id, *([eos] if eos is not None else [])]))
        pad = hf.pad_token_id
        self._pad_id = pad if pad is not None else self._end_id

    @classmethod
    def load(cls, path: str | Path, chat_template: str | None = None) -> HFChatTokenizer:
        from transformers import AutoTokenizer  # only real models need transformers here

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model.tokenizer: cannot load a tokenizer from {path} ({exc})") from None
        return cls(hf, chat_template, where=f"model.tokenizer {path}")

    # ------------------------------------------------------------------ the protocol
    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def end_id(self) -> int:
        return self._end_id

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    def chat_prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
        return self._render([_dict(m) for m in messages], tools, generation_prompt=True)

    def observation_ids(self, role: str, text: str, max_tokens: int | None = None) -> list[int]:
        if max_tokens is not None:
            ids = self.hf.encode(text, add_special_tokens=False)
            if len(ids) > max_tokens:
                text = self.hf.decode(ids[:max_tokens])
        probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_REPLY}]
        before = self._render(probe, (), generation_prompt=False)
        after = self._render([*probe, {"role": role, "content": text}], (), generation_prompt=True)
        if after[: len(before)] != before or self._end_id not in before:
            raise ValueError(
                f"{self.where}: the chat template renders earlier turns differently once a {role} turn"
                " follows; a turn cannot be appended without re-tokenizing (set model.chatTemplate)"
            )
        last_end = len(before) - 1 - before[::-1].index(self._end_id)
        return after[last_end + 1 :]

    def reply_text(self, ids: Sequence[int]) -> str:
        body = list(ids)
        if body and body[-1] in self._stop_ids:
            body.pop()
        return self.hf.decode(body)

    # ------------------------------------------------------------------ helpers
    def _render(
        self, messages: list[dict[str, str]], tools: Sequence[Tool], generation_prompt: bool
    ) -> list[int]:
        rendered = self.hf.apply_chat_template(
            messages,
            tools=[tool.schema() for tool in tools] or None,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=True,
        )
        return list(rendered["input_ids"])

    def _find_end_id(self) -> int:
        """The token that ends an assistant turn: the first one the template puts after its text."""
        user = [{"role": "user", "content": PROBE_USER}]
        prompt = self.hf.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        whole = self.hf.apply_chat_template(
            [*user, {"role": "assistant", "content": PROBE_REPLY}],
            add_generation_prompt=False,
            tokenize=False,
        )
        tail = whole[len(prompt) :] if whole.startswith(prompt) else whole
        if PROBE_REPLY not in tail:
            raise ValueError(f"{self.where}: the chat template does not render an assistant turn's content")
        after = tail.split(PROBE_REPLY, 1)[1]
        ids = self.hf.encode(after, add_special_tokens=False)
        if not ids:
            raise ValueError(f"{self.where}: the chat template ends an assistant turn with no token")
        return int(ids[0])


def _dict(message: Message) -> dict[str, str]:
    return {"role": message.role, "content": message.content}


def load_chat_tokenizer(
    path: str | Path | None, chat_template: str | None, vocabulary: Sequence[str] | None, environment: str
) -> ChatTokenizer:
    """The rollout's tokenizer: a mixrl word-tokenizer JSON file, a Hugging Face tokenizer directory
    (with ``chat_template`` overriding its own), or, with no path, the word tokenizer over the
    environment's vocabulary."""
    if path is None:
        if vocabulary is None:
            raise ValueError(f"--tokenizer: {environment} has no word vocabulary; give the model's tokenizer")
        return Tokenizer.from_words(vocabulary)
    word_file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if Path(path).is_dir() and not _is_word_tokenizer(word_file):
        return HFChatTokenizer.load(path, chat_template)
    if chat_template is not None:
        raise ValueError(f"model.chatTemplate: {path} is mixrl's word tokenizer, which renders chats itself")
    return Tokenizer.load(word_file)


def _is_word_tokenizer(path: Path) -> bool:
    """Whether ``path`` is a mixrl word-tokenizer file (what ``mixrl run`` saves beside a tiny model)."""
    try:
        with path.open(encoding="utf-8") as file:
            head = file.read(256)
    except OSError:
        return False
    return f'"format": "{FORMAT}"' in head
