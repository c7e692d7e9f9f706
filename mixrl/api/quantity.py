"""Kubernetes resource quantities (``500Gi``, ``1.5``, ``100m``, ``1e3``), parsed by Kubernetes' rules.

The grammar is apimachinery's (``k8s.io/apimachinery/pkg/api/resource``)::

    <quantity>        ::= <signedNumber><suffix>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= e <signedInteger> | E <signedInteger>

so ``1K``, ``1ki``, ``1e1.5``, ``5 Gi`` and ``lots`` are refused as the API server refuses them, and
``1E`` is an exa (10^18), not an exponent.  Every quantity the RLRun API takes (volume size, CPU,
memory) must be positive, and at most :data:`MAX_QUANTITY` base units: Kubernetes reads a
quantity's value as an int64 (``Quantity.Value()``), so anything larger wraps around in the
kubelet or the PVC controller.
"""

from __future__ import annotations

import re
from fractions import Fraction

BINARY_SI: dict[str, int] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL_SI: dict[str, int] = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}  # fmt: skip
"""Suffix -> power of ten."""
MAX_QUANTITY = 2**63 - 1
"""Largest value (in base units: bytes, cores) Kubernetes can hold as an int64."""
MAX_LENGTH = 64
"""Longest quantity string accepted; real ones are a handful of characters (the CRD's maxLength)."""

_SUFFIX = r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"
_QUANTITY = re.compile(r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)" + _SUFFIX)
POSITIVE_PATTERN = (
    r"^\+?(0*[1-9][0-9]*(\.[0-9]*)?|[0-9]*\.[0-9]*[1-9][0-9]*)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
"""The same grammar, restricted to positive values, as an RE2 pattern for the CRD schema: at least
one non-zero digit in the number, no minus sign (the API server has no lookahead to say it shorter)."""

EXAMPLES = "e.g. 500Gi, 1.5, 100m, 1e3"


class QuantityError(ValueError):
    """Not a Kubernetes quantity, or one out of range; the message is one line for the user."""


def parse_quantity(text: str) -> Fraction:
    """The exact value of a Kubernetes quantity, in base units (``"1.5Gi"`` -> 1610612736)."""
    if len(text) > MAX_LENGTH:
        raise QuantityError(f"a quantity has at most {MAX_LENGTH} characters, got {len(text)}")
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise QuantityError(f"{text!r} is not a Kubernetes quantity ({EXAMPLES})")
    whole, _, fraction = match["number"].partition(".")
    mantissa = Fraction(int(whole or "0") * 10 ** len(fraction) + int(fraction or "0"), 10 ** len(fraction))
    if match["sign"] == "-":
        mantissa = -mantissa
    suffix = match["suffix"] or ""
    if suffix in BINARY_SI:
        return mantissa * BINARY_SI[suffix]
    exponent = DECIMAL_SI[suffix] if suffix in DECIMAL_SI else int(suffix[1:])
    # Bound the exponent before raising ten to it: "1e999999999" must not compute a huge integer.
    # A mantissa of at most MAX_LENGTH digits lies within 10^±MAX_LENGTH, so beyond these exponents
    # the value is certainly above MAX_QUANTITY (or below any real resource: it keeps only its sign).
    if mantissa != 0 and exponent > 2 * MAX_LENGTH:
        raise QuantityError(f"{text!r} is larger than {MAX_QUANTITY} (the int64 Kubernetes stores)")
    exponent = max(exponent, -2 * MAX_LENGTH)
    return mantissa * Fraction(10) ** exponent


def positive_quantity(text: str) -> str:
    """``text`` unchanged when it is a positive quantity within int64; else QuantityError."""
    value = parse_quantity(text)
    if value <= 0:
        raise QuantityError(f"{text!r} must be a positive quantity ({EXAMPLES})")
    if value > MAX_QUANTITY:
        raise QuantityError(f"{text!r} is larger than {MAX_QUANTITY} (the int64 Kubernetes stores)")
    return text
