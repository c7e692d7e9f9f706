"""Kubernetes' name rules (``k8s.io/apimachinery/pkg/util/validation``), for the names an RLRun carries
into the objects the operator creates: its namespace, labels, annotations, node selectors,
tolerations, GPU product names and priority class.

Each check returns None for a valid value, else a one-line reason.  Checking here, rather than
leaving it to the API server when the operator applies the run's children, turns an apply that
fails on a Deployment much later into one line from ``mixrl validate``.  The patterns are RE2-safe,
so the same strings go into the CRD schema.
"""

from __future__ import annotations

import re

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN_MAX = 253
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
"""A label value: empty, or at most 63 alphanumerics, '-', '_', '.', starting and ending alphanumeric."""
LABEL_VALUE_MAX = 63
QUALIFIED_NAME_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
"""A label or annotation key: an optional DNS-subdomain prefix and '/', then a name part of at most
63 characters (the prefix's own 253-character limit is left to maxLength and the Python check)."""
QUALIFIED_NAME_MAX = DNS_SUBDOMAIN_MAX + 1 + 63
ANNOTATIONS_MAX_BYTES = 256 * 1024
"""Kubernetes' TotalAnnotationSizeLimitB: keys and values of all annotations together."""

_DNS_LABEL = re.compile(DNS_LABEL_PATTERN)
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN_PATTERN)
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(LABEL_VALUE_PATTERN)

_LABEL_RULE = "at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"


def shown(value: str, limit: int = 60) -> str:
    """A user's string as it appears in a message: quoted, escaped, and cut (a message stays one
    short line, whatever was pasted into the field)."""
    if len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    return repr(value)


def _length_and_pattern_problem(value: str, limit: int, pattern: re.Pattern[str], kind: str) -> str | None:
    if len(value) > limit:
        return f"{shown(value)} is longer than {limit} characters"
    if not pattern.match(value):
        return f"{shown(value)} is not {kind}"
    return None


def dns_label_problem(value: str) -> str | None:
    """RFC 1123 label: namespaces, object names."""
    kind = "a DNS label (lowercase alphanumerics and '-', starting and ending alphanumeric)"
    return _length_and_pattern_problem(value, DNS_LABEL_MAX, _DNS_LABEL, kind)


def dns_subdomain_problem(value: str) -> str | None:
    """RFC 1123 subdomain: label-key prefixes, PriorityClass and StorageClass names."""
    kind = "a DNS subdomain (lowercase alphanumerics, '-' and '.')"
    return _length_and_pattern_problem(value, DNS_SUBDOMAIN_MAX, _DNS_SUBDOMAIN, kind)


def qualified_name_problem(value: str) -> str | None:
    """A label or annotation key, a toleration key: ``[prefix/]name``."""
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or dns_subdomain_problem(prefix) is not None):
        return f"{shown(value)}: the prefix before '/' must be a DNS subdomain (e.g. example.com/name)"
    if not name:
        return f"{shown(value)}: the name part is empty"
    if len(name) > 63 or not _NAME_PART.match(name):
        return f"{shown(value)}: the name part must be {_LABEL_RULE}"
    return None


def label_value_problem(value: str) -> str | None:
    if len(value) > LABEL_VALUE_MAX or not _LABEL_VALUE.match(value):
        return f"{shown(value)} is not a label value ({_LABEL_RULE}, or empty)"
    return None


def labels_problem(labels: dict[str, str]) -> str | None:
    """The first invalid key or value of a label map (metadata.labels, a node selector)."""
    for key, value in labels.items():
        problem = qualified_name_problem(key)
        if problem is not None:
            return f"key {problem}"
        problem = label_value_problem(value)
        if problem is not None:
            return f"value of {shown(key)}: {problem}"
    return None


def annotations_problem(annotations: dict[str, str]) -> str | None:
    for key in annotations:
        problem = qualified_name_problem(key)
        if problem is not None:
            return f"key {problem}"
    # surrogatepass: a YAML escape can make a lone surrogate, which strict UTF-8 cannot encode
    size = sum(
        len(k.encode(errors="surrogatepass")) + len(v.encode(errors="surrogatepass"))
        for k, v in annotations.items()
    )
    if size > ANNOTATIONS_MAX_BYTES:
        return f"{size} bytes in all, more than Kubernetes' {ANNOTATIONS_MAX_BYTES}"
    return None
