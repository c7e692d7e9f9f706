"""Kubernetes quantities and names, by Kubernetes' rules (apimachinery's resource and validation
packages), and the CRD patterns that let the API server refuse the same strings."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.api import names
from mixrl.api.quantity import (
    MAX_QUANTITY,
    POSITIVE_PATTERN,
    QuantityError,
    parse_quantity,
    positive_quantity,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500Gi", 500 * 2**30),
        ("1.5", Fraction(3, 2)),
        ("100m", Fraction(1, 10)),
        ("1e3", 1000),
        ("1E3", 1000),
        ("1E", 10**18),  # exa, not an exponent
        ("2k", 2000),
        ("1Ki", 1024),
        ("1.5Gi", 3 * 2**29),
        (".5", Fraction(1, 2)),
        ("1.", 1),
        ("+3", 3),
        ("-5Gi", -5 * 2**30),
        ("0", 0),
        ("7Ei", 7 * 2**60),
        ("250n", Fraction(250, 10**9)),
        ("3u", Fraction(3, 10**6)),
        ("1e-3", Fraction(1, 1000)),
    ],
)
def test_parse(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1K", "1ki", "1e1.5", "5 Gi", " 5Gi", "1e", "1.2.3", "Gi", ".", "+", "0x10", "1Gib", "1_000"])  # fmt: skip
def test_not_quantities(text: str) -> None:
    with pytest.raises(QuantityError, match="is not a Kubernetes quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-5Gi", "'-5Gi' must be a positive quantity"),
        ("0", "'0' must be a positive quantity"),
        ("0.000", "'0.000' must be a positive quantity"),
        ("8Ei", "'8Ei' is larger than 9223372036854775807"),
        ("1e999999999", "'1e999999999' is larger than 9223372036854775807"),  # computes nothing huge
        ("1" * 65, "a quantity has at most 64 characters, got 65"),
    ],
)
def test_positive_quantity_refuses(text: str, message: str) -> None:
    with pytest.raises(QuantityError, match=re.escape(message)):
        positive_quantity(text)


def test_tiny_exponents_stay_cheap_and_positive() -> None:
    assert 0 < parse_quantity("1e-999999999") < Fraction(1, 10**100)
    assert positive_quantity("1e-999999999") == "1e-999999999"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="0123456789.+-eEKMGTPinumk", max_size=8))
def test_crd_pattern_is_the_parser(text: str) -> None:
    # What the API server accepts (the pattern) is what mixrl accepts, up to the int64 bound, which a
    # pattern cannot express.
    try:
        accepted = parse_quantity(text) > 0
    except QuantityError as exc:
        accepted = "larger than" in str(exc)  # well-formed, positive, beyond int64
    assert bool(re.match(POSITIVE_PATTERN, text)) == accepted, text


def test_the_int64_bound_is_the_only_difference() -> None:
    assert re.match(POSITIVE_PATTERN, "8Ei") and parse_quantity("8Ei") > MAX_QUANTITY


# ----------------------------------------------------------------------------- names

LABEL_KEYS_OK = ["app", "a", "app.kubernetes.io/name", "nvidia.com/gpu.product", "A_b-c.D", "x" * 63, "example.com/" + "y" * 63]  # fmt: skip
LABEL_KEYS_BAD = ["", "-app", "app-", "a b", "/app", "Example.com/app", "a/b/c", "x" * 64, "example.com/", "é"]  # fmt: skip


@pytest.mark.parametrize("key", LABEL_KEYS_OK)
def test_qualified_names(key: str) -> None:
    assert names.qualified_name_problem(key) is None
    assert re.match(names.QUALIFIED_NAME_PATTERN, key) and len(key) <= names.QUALIFIED_NAME_MAX


@pytest.mark.parametrize("key", LABEL_KEYS_BAD)
def test_not_qualified_names(key: str) -> None:
    assert names.qualified_name_problem(key) is not None
    assert not re.match(names.QUALIFIED_NAME_PATTERN, key) or len(key) > names.QUALIFIED_NAME_MAX


@pytest.mark.parametrize(
    ("value", "ok"),
    [("", True), ("NVIDIA-H100-80GB-HBM3", True), ("a.b_c-d", True), ("v" * 63, True), ("v" * 64, False),
     ("-a", False), ("a b", False), ("a/b", False)],
)  # fmt: skip
def test_label_values(value: str, ok: bool) -> None:
    assert (names.label_value_problem(value) is None) is ok
    assert bool(re.match(names.LABEL_VALUE_PATTERN, value) and len(value) <= 63) is ok


@pytest.mark.parametrize(
    ("value", "label", "subdomain"),
    [("rl", True, True), ("rl-team", True, True), ("a.b", False, True), ("RL", False, False), ("-rl", False, False),
     ("r" * 63, True, True), ("r" * 64, False, True), ("a_b", False, False), ("", False, False)],
)  # fmt: skip
def test_dns_names(value: str, label: bool, subdomain: bool) -> None:
    assert (names.dns_label_problem(value) is None) is label
    assert (names.dns_subdomain_problem(value) is None) is subdomain


def test_annotations_total_size_with_a_lone_surrogate() -> None:
    # A YAML escape can produce a lone surrogate; counting its bytes must not raise.
    assert names.annotations_problem({"note": "\ud800"}) is None
    assert names.annotations_problem({"a": "x" * names.ANNOTATIONS_MAX_BYTES}) is not None


def test_shown_cuts_long_values() -> None:
    assert names.shown("abc") == "'abc'"
    assert names.shown("x" * 1000) == repr("x" * 60) + "... (1000 characters)"
