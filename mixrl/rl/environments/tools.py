"""Tools, tool calls, and the parsers that find a tool call in a reply's text.

An environment picks its parser (:attr:`mixrl.rl.environments.base.Environment.parser`):

- :class:`PlainTextParser`: ``name arg1 arg2 ...``, the first word names the tool and the next
  words fill its parameters in the schema's order, one word each; for the tools named in
  ``rest_of_reply`` the last parameter takes every remaining word.  What tiny models and the
  word tokenizer use (filetree: ``ls``, ``cat net.cfg``, ``submit port 42``).
- :class:`JsonToolCallParser`: the Hermes / Qwen convention real chat models are trained on,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (or a reply that is only that JSON
  object).

Either returns None for a reply without a valid call: no call, more than one, a tool not offered,
missing or unknown arguments, or arguments of the wrong JSON type.  mixrl counts those replies
(``rollout.formatErrorLimit``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A tool the environment offers: its name and a JSON Schema (an ``object``) of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"tool name: must be one word, got {self.name!r}")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name}: parameters must be a JSON Schema of type object")

    @property
    def parameter_names(self) -> list[str]:
        """The argument names, in the schema's order (the plain-text parser fills them in order)."""
        return list(self.parameters.get("properties", {}))

    def schema(self) -> dict[str, Any]:
        """The OpenAI / verifiers tool format, for chat templates that render tools."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    def arguments_fit(self, arguments: Mapping[str, Any]) -> bool:
        """Whether ``arguments`` has every required parameter, no unknown one, and the declared
        JSON type of each (top level only; an environment checks deeper if it needs to)."""
        properties: Mapping[str, Any] = self.parameters.get("properties", {})
        if any(name not in arguments for name in self.parameters.get("required", ())):
            return False
        for name, value in arguments.items():
            schema = properties.get(name)
            if schema is None:
                return False
            kind = schema.get("type")
            if kind is None:
                continue
            kinds = [kind] if isinstance(kind, str) else list(kind)
            types = tuple(t for k in kinds for t in _JSON_TYPES.get(k, ()))
            # bool is an int in Python, not in JSON
            if not isinstance(value, types) or (isinstance(value, bool) and "boolean" not in kinds):
                return False
        return True


def string_parameters(*names: str) -> dict[str, Any]:
    """The parameters of a tool whose arguments are the strings ``names``, each required, in this
    order (the order :class:`PlainTextParser` fills them in)."""
    return {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names},
        "required": list(names),
    }


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the tool's name and its arguments (checked against its schema)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


class ToolCallParser(Protocol):
    def parse(self, reply: str, tools: Sequence[Tool]) -> ToolCall | None:
        """The call ``reply`` makes to one of ``tools`` (the offered ones), or None."""
        ...


@dataclass(frozen=True)
class PlainTextParser:
    """``name arg1 arg2 ...``; each parameter takes one word, except that the last parameter of a
    tool named in ``rest_of_reply`` takes all the remaining words (joined by single spaces).
    Words for ``integer`` / ``number`` parameters are converted; a word that is not one fails."""

    rest_of_reply: Collection[str] = ()

    def parse(self, reply: str, tools: Sequence[Tool]) -> ToolCall | None:
        words = reply.split()
        tool = next((t for t in tools if words and t.name == words[0]), None)
        if tool is None:
            return None
        names, values = tool.parameter_names, words[1:]
        if tool.name in self.rest_of_reply and names:
            if len(values) < len(names):
                return None
            values = [*values[: len(names) - 1], " ".join(values[len(names) - 1 :])]
        if len(values) != len(names):
            return None
        properties = tool.parameters.get("properties", {})
        arguments: dict[str, Any] = {}
        for name, word in zip(names, values, strict=True):
            converted = _convert_word(word, properties[name].get("type"))
            if converted is None:
                return None
            arguments[name] = converted
        return ToolCall(tool.name, arguments) if tool.arguments_fit(arguments) else None


def _convert_word(word: str, kind: Any) -> Any:
    try:
        if kind == "integer":
            return int(word)
        if kind == "number":
            return float(word)
    except ValueError:
        return None
    return word


_TOOL_CALL_TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class JsonToolCallParser:
    """Exactly one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the reply, or a
    reply that is only such a JSON object (``arguments`` may be a JSON string of the object, as
    OpenAI's API sends it)."""

    def parse(self, reply: str, tools: Sequence[Tool]) -> ToolCall | None:
        tagged = _TOOL_CALL_TAG.findall(reply)
        if len(tagged) > 1:
            return None
        body = tagged[0] if tagged else reply
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or set(data) - {"name", "arguments"}:
            return None
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        tool = next((t for t in tools if t.name == data.get("name")), None)
        if tool is None or not isinstance(arguments, dict) or not tool.arguments_fit(arguments):
            return None
        return ToolCall(tool.name, arguments)
