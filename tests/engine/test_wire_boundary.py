"""The ``/generate`` wire format is encoded and decoded in one module: mixrl/rl/engine/protocol.py.

Any other module of mixrl that spells one of the format's field names (SGLang's request and
``meta_info`` fields, mixrl's per-token extras, the router's ``X-Mixrl-*`` headers) as a string is
building or reading the format by hand; it should call the protocol module instead.  (The
import-linter contract "the wire format module is pure" keeps that module free of torch and HTTP.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import mixrl

WIRE_MODULE = Path("rl/engine/protocol.py")
WIRE_NAMES = frozenset(
    {
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_sampling_mask",
        "meta_info",
        "completion_tokens",
        "output_token_logprobs",
        "output_top_logprobs",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
        "output_token_support_size",
        "output_token_weight_versions",
        "X-Mixrl-Session",
        "X-Mixrl-Pool",
        "X-Mixrl-Gpu-Type",
        "X-Mixrl-Precision",
        "X-Mixrl-Replica",
    }
)


def wire_strings(source: str) -> list[tuple[int, str]]:
    """(line, name) of every wire-format name ``source`` spells: a string constant that is exactly
    one, or a bytes constant (a pattern over raw bodies) that contains one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Constant):
            continue
        if isinstance(node.value, str) and node.value in WIRE_NAMES:
            found.append((node.lineno, node.value))
        elif isinstance(node.value, bytes):
            text = node.value.decode("utf-8", "replace")
            found += [(node.lineno, name) for name in sorted(WIRE_NAMES) if f'"{name}"' in text]
    return found


def test_only_the_protocol_module_spells_the_wire_format() -> None:
    root = Path(mixrl.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{line}: {name!r}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root) != WIRE_MODULE
        for line, name in wire_strings(path.read_text())
    ]
    assert not offenders, "wire-format names outside mixrl/rl/engine/protocol.py:\n" + "\n".join(offenders)
    assert wire_strings((root / WIRE_MODULE).read_text()), "the protocol module no longer holds the format"


def test_the_check_sees_a_hand_built_body() -> None:
    assert wire_strings('body = {"sampling_params": {}, "top_logprobs_num": 4}') == [
        (1, "sampling_params"),
        (1, "top_logprobs_num"),
    ]
    assert wire_strings('"""Docs may name meta_info and top_logprobs_num in prose."""') == []
    assert wire_strings("""pattern = rb'"completion_tokens"\\s*:'""") == [(1, "completion_tokens")]
