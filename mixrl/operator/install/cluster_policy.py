"""The cluster's policy on what an RLRun may ask the operator to run, checked twice from one place.

An RLRun can name its own images (``trainer.image``, a pool's ``image``, ``rollout.sandbox.image``),
extra engine arguments (``engineArgs``) and scheduling overrides (``nodeSelector``, ``tolerations``,
``gpuProducts``, ``priorityClassName``), and the operator runs them with its own permissions.  A
platform restricts that with the chart's ``policy`` values, which reach two enforcers:

- the operator (``mixrl operator --allowed-image-prefix … --no-engine-args …``): :func:`violations`
  on every reconcile, so a run that got past admission (created before the policy, or with
  admission off) is marked ``PolicyViolation`` and nothing of it is created or changed;
- the API server: a ValidatingAdmissionPolicy the chart installs, whose CEL comes from
  :func:`admission_rules` (``python -m mixrl.operator.install.chart`` writes it into the chart), so
  ``kubectl apply`` of a violating RLRun is refused with the same line the operator would report.

Both report ``path: reason`` lines in the same order (the CEL validations are listed in the order
:func:`violations` checks), one per kind of problem, each naming its first offender.  Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mixrl.api.models import RLRunSpec, Scheduling

POLICY = "the cluster's policy"
SCHEDULING_FIELDS = ("nodeSelector", "tolerations", "gpuProducts")
"""Scheduling overrides that ``allowScheduling: false`` refuses (priorityClassName has its own list)."""
FLAG_CHARS = r"[-A-Za-z0-9_.]{1,100}"
"""A flag shown in a message as it is; anything else (a pasted blob, a newline) is "this argument"."""
VALUE_VARIABLES = (
    "allowedImages",
    "allowEngineArgs",
    "allowedEngineFlags",
    "allowScheduling",
    "allowedPriorityClasses",
)
"""The admission policy's variables the chart renders from its values (CEL literals), in this order,
before the generated ones."""


@dataclass(frozen=True)
class Policy:
    """What RLRuns may ask for.  The defaults allow everything (the chart's defaults too)."""

    allowed_images: tuple[str, ...] = ()
    """Prefixes an RLRun's own images (the trainer's, a pool's, the sandbox pods') must start with;
    empty: any image.  Runs that name none get the operator's images, which this does not restrict."""
    allow_engine_args: bool = True
    """False: no pool may pass extra engine arguments."""
    allowed_engine_flags: tuple[str, ...] = ()
    """When not empty: the only flags ``engineArgs`` may hold (``--flag`` or ``--flag=value``; an
    argument that does not start with ``-`` is the value of the flag before it)."""
    allow_scheduling: bool = True
    """False: no nodeSelector, tolerations or gpuProducts in the trainer's or a pool's scheduling."""
    allowed_priority_classes: tuple[str, ...] = ()
    """When not empty: the priorityClassName values a run may name (whatever ``allow_scheduling``
    says); empty: priority classes follow ``allow_scheduling``."""

    @property
    def restricts(self) -> bool:
        return self != Policy()

    def image_allowed(self, image: str) -> bool:
        return not self.allowed_images or any(image.startswith(p) for p in self.allowed_images)

    def argument_allowed(self, argument: str) -> bool:
        if not argument.startswith("-") or not self.allowed_engine_flags:
            return True
        return any(argument == f or argument.startswith(f + "=") for f in self.allowed_engine_flags)

    def priority_class_allowed(self, name: str) -> bool:
        if self.allowed_priority_classes:
            return name in self.allowed_priority_classes
        return self.allow_scheduling


OPEN = Policy()


# ----------------------------------------------------------------------------- messages


def image_line(path: str, image: str, policy: Policy) -> str:
    allowed = ", ".join(policy.allowed_images)
    return f"{path}: {image} is not an allowed image ({POLICY} allows images starting with {allowed})"


def engine_args_line(path: str) -> str:
    return f"{path}: extra engine arguments are not allowed by {POLICY}"


def flag_shown(argument: str) -> str:
    flag = argument.split("=", 1)[0]
    return flag if re.fullmatch(FLAG_CHARS, flag) else "this argument"


def engine_flag_line(path: str, argument: str, policy: Policy) -> str:
    allowed = ", ".join(policy.allowed_engine_flags)
    return f"{path}: {flag_shown(argument)} is not an allowed engine flag ({POLICY} allows {allowed})"


def scheduling_line(path: str) -> str:
    return f"{path}: scheduling overrides are not allowed by {POLICY}"


def priority_class_line(path: str, name: str, policy: Policy) -> str:
    if policy.allowed_priority_classes:
        allowed = ", ".join(policy.allowed_priority_classes)
        return f"{path}: {name} is not an allowed priority class ({POLICY} allows {allowed})"
    return f"{path}: priority classes are not allowed by {POLICY}"


# ----------------------------------------------------------------------------- the operator's check


def _overrides(scheduling: Scheduling) -> dict[str, bool]:
    """Which scheduling overrides are set (an empty map or list sets nothing)."""
    return {
        "nodeSelector": bool(scheduling.node_selector),
        "tolerations": bool(scheduling.tolerations),
        "gpuProducts": bool(scheduling.gpu_products),
    }


def violations(policy: Policy, spec: RLRunSpec) -> list[str]:
    """One ``path: reason`` line per kind of problem (its first offender), in the admission
    policy's order; empty when the policy allows the run."""
    if not policy.restricts:
        return []
    return [line for line in _checks(policy, spec) if line is not None]


def violation(policy: Policy, spec: RLRunSpec) -> str | None:
    """The one line the operator reports: the first violation, and how many more there are."""
    found = violations(policy, spec)
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return found[0] + more


def _checks(policy: Policy, spec: RLRunSpec) -> Iterator[str | None]:
    trainer, pools, sandbox = spec.trainer, list(enumerate(spec.sampler_pools)), spec.rollout.sandbox
    at = "spec.samplerPools[{}]".format
    yield (
        image_line("spec.trainer.image", trainer.image, policy)
        if trainer.image is not None and not policy.image_allowed(trainer.image)
        else None
    )
    yield _first(
        image_line(f"{at(i)}.image", p.image, policy)
        for i, p in pools
        if p.image is not None and not policy.image_allowed(p.image)
    )
    yield (
        image_line("spec.rollout.sandbox.image", sandbox.image, policy)
        if sandbox is not None and sandbox.image is not None and not policy.image_allowed(sandbox.image)
        else None
    )
    yield _first(
        engine_args_line(f"{at(i)}.engineArgs")
        for i, p in pools
        if p.engine_args and not policy.allow_engine_args
    )
    yield (
        _first(
            engine_flag_line(f"{at(i)}.engineArgs[{j}]", a, policy)
            for i, p in pools
            for j, a in enumerate(p.engine_args)
            if not policy.argument_allowed(a)
        )
        if policy.allow_engine_args
        else None
    )
    for field in SCHEDULING_FIELDS:
        yield (
            scheduling_line(f"spec.trainer.scheduling.{field}")
            if not policy.allow_scheduling and _overrides(trainer.scheduling)[field]
            else None
        )
    name = trainer.scheduling.priority_class_name
    yield (
        priority_class_line("spec.trainer.scheduling.priorityClassName", name, policy)
        if name is not None and not policy.priority_class_allowed(name)
        else None
    )
    for field in SCHEDULING_FIELDS:
        yield _first(
            scheduling_line(f"{at(i)}.scheduling.{field}")
            for i, p in pools
            if not policy.allow_scheduling and _overrides(p.scheduling)[field]
        )
    yield _first(
        priority_class_line(f"{at(i)}.scheduling.priorityClassName", p.scheduling.priority_class_name, policy)
        for i, p in pools
        if p.scheduling.priority_class_name is not None
        and not policy.priority_class_allowed(p.scheduling.priority_class_name)
    )


def _first(lines: Iterator[str]) -> str | None:
    return next(lines, None)


# ----------------------------------------------------------------------------- the admission policy

Rule = dict[str, str]


def _lit(text: str) -> str:
    """A CEL string literal (JSON's double-quoted strings are CEL's)."""
    return json.dumps(text)


def _concat(*parts: str) -> str:
    return " + ".join(parts)


def _present(base: str, *keys: str) -> str:
    """CEL: every key along the chain is set (``has`` needs each parent to exist)."""
    return " && ".join(f"has({base}.{'.'.join(keys[: n + 1])})" for n in range(len(keys)))


def _nonempty(base: str, *keys: str) -> str:
    return f"{_present(base, *keys)} && size({base}.{'.'.join(keys)}) > 0"


def _pool_path(pool: str, suffix: str) -> str:
    """CEL: ``spec.samplerPools[<index of pool>]<suffix>`` (pool names are unique: the CRD says so)."""
    return _concat(
        _lit("spec.samplerPools["), f"string(variables.poolNames.indexOf({pool}.name))", _lit("]" + suffix)
    )


TRAINER = "object.spec.trainer"
SANDBOX = "object.spec.rollout.sandbox"
BAD_FLAG = 'a.startsWith("-") && !variables.allowedEngineFlags.exists(f, a == f || a.startsWith(f + "="))'
PRIORITY_ALLOWED = (
    "(size(variables.allowedPriorityClasses) > 0 ? {name} in variables.allowedPriorityClasses"
    " : variables.allowScheduling)"
)
CAPS = {"nodeSelector": "NodeSelector", "tolerations": "Tolerations", "gpuProducts": "GpuProducts"}


def admission_rules() -> dict[str, list[Rule]]:
    """The ValidatingAdmissionPolicy's generated ``variables`` (after :data:`VALUE_VARIABLES`) and
    ``validations``, in :func:`violations`' order, with the same messages."""
    allowed_images = 'variables.allowedImages.join(", ")'
    pools = "object.spec.samplerPools"
    variables: list[Rule] = [
        {"name": "poolNames", "expression": f"{pools}.map(p, p.name)"},
        {
            "name": "poolsWithBadImage",
            "expression": f"{pools}.filter(p, has(p.image) && !variables.allowedImages.exists(x, p.image.startsWith(x)))",
        },
        {
            "name": "poolsWithArgs",
            "expression": f"{pools}.filter(p, has(p.engineArgs) && size(p.engineArgs) > 0)",
        },
        {
            "name": "poolsWithBadFlag",
            "expression": f"{pools}.filter(p, has(p.engineArgs) && p.engineArgs.exists(a, {BAD_FLAG}))",
        },
        {
            "name": "badFlag",
            "expression": (
                f"size(variables.poolsWithBadFlag) > 0 ? variables.poolsWithBadFlag[0].engineArgs.filter(a, {BAD_FLAG})[0] : {_lit('')}"
            ),
        },
        {"name": "badFlagName", "expression": 'variables.badFlag.split("=")[0]'},
        *(
            {
                "name": f"poolsWith{CAPS[field]}",
                "expression": f"{pools}.filter(p, {_nonempty('p', 'scheduling', field)})",
            }
            for field in SCHEDULING_FIELDS
        ),
        {
            "name": "poolsWithBadPriorityClass",
            "expression": f"{pools}.filter(p, {_present('p', 'scheduling', 'priorityClassName')} && !{PRIORITY_ALLOWED.format(name='p.scheduling.priorityClassName')})",
        },
    ]
    image_reason = _concat(
        _lit(f" is not an allowed image ({POLICY} allows images starting with "), allowed_images, _lit(")")
    )
    flag_shown_cel = f"(variables.badFlagName.matches({_lit('^' + FLAG_CHARS + '$')}) ? variables.badFlagName : {_lit('this argument')})"
    bad_flag_pool = "variables.poolsWithBadFlag[0]"
    validations: list[Rule] = [
        {
            "expression": f"size(variables.allowedImages) == 0 || !({_present('object.spec', 'trainer', 'image')}) || variables.allowedImages.exists(x, {TRAINER}.image.startsWith(x))",
            "messageExpression": _concat(_lit("spec.trainer.image: "), f"{TRAINER}.image", image_reason),
        },
        {
            "expression": "size(variables.allowedImages) == 0 || size(variables.poolsWithBadImage) == 0",
            "messageExpression": _concat(
                _pool_path("variables.poolsWithBadImage[0]", ".image: "),
                "variables.poolsWithBadImage[0].image",
                image_reason,
            ),
        },
        {
            "expression": f"size(variables.allowedImages) == 0 || !({_present('object.spec', 'rollout', 'sandbox', 'image')}) || variables.allowedImages.exists(x, {SANDBOX}.image.startsWith(x))",
            "messageExpression": _concat(
                _lit("spec.rollout.sandbox.image: "), f"{SANDBOX}.image", image_reason
            ),
        },
        {
            "expression": "variables.allowEngineArgs || size(variables.poolsWithArgs) == 0",
            "messageExpression": _concat(
                _pool_path("variables.poolsWithArgs[0]", ".engineArgs: "),
                _lit(f"extra engine arguments are not allowed by {POLICY}"),
            ),
        },
        {
            "expression": "!variables.allowEngineArgs || size(variables.allowedEngineFlags) == 0 || size(variables.poolsWithBadFlag) == 0",
            "messageExpression": _concat(
                _pool_path(bad_flag_pool, ".engineArgs["),
                f"string({bad_flag_pool}.engineArgs.indexOf(variables.badFlag))",
                _lit("]: "),
                flag_shown_cel,
                _lit(f" is not an allowed engine flag ({POLICY} allows "),
                'variables.allowedEngineFlags.join(", ")',
                _lit(")"),
            ),
        },
        *(
            {
                "expression": f"variables.allowScheduling || !({_nonempty('object.spec', 'trainer', 'scheduling', field)})",
                "messageExpression": _lit(scheduling_line(f"spec.trainer.scheduling.{field}")),
            }
            for field in SCHEDULING_FIELDS
        ),
        {
            "expression": f"!({_present('object.spec', 'trainer', 'scheduling', 'priorityClassName')}) || {PRIORITY_ALLOWED.format(name=TRAINER + '.scheduling.priorityClassName')}",
            "messageExpression": _priority_message(
                _lit("spec.trainer.scheduling.priorityClassName: "), f"{TRAINER}.scheduling.priorityClassName"
            ),
        },
        *(
            {
                "expression": f"variables.allowScheduling || size(variables.poolsWith{CAPS[field]}) == 0",
                "messageExpression": _concat(
                    _pool_path(f"variables.poolsWith{CAPS[field]}[0]", f".scheduling.{field}: "),
                    _lit(f"scheduling overrides are not allowed by {POLICY}"),
                ),
            }
            for field in SCHEDULING_FIELDS
        ),
        {
            "expression": "size(variables.poolsWithBadPriorityClass) == 0",
            "messageExpression": _priority_message(
                _pool_path("variables.poolsWithBadPriorityClass[0]", ".scheduling.priorityClassName: "),
                "variables.poolsWithBadPriorityClass[0].scheduling.priorityClassName",
            ),
        },
    ]
    for rule in validations:
        rule["reason"] = (
            "Forbidden"  # the cluster refuses it (403), as RBAC would, not a malformed object (422)
        )
    return {"variables": variables, "validations": validations}


def _priority_message(path: str, name: str) -> str:
    listed = _concat(
        path,
        name,
        _lit(f" is not an allowed priority class ({POLICY} allows "),
        'variables.allowedPriorityClasses.join(", ")',
        _lit(")"),
    )
    refused = _concat(path, _lit(f"priority classes are not allowed by {POLICY}"))
    return f"size(variables.allowedPriorityClasses) > 0 ? {listed} : {refused}"


def value_variables(policy: Policy) -> list[Rule]:
    """The variables the chart renders from its values, as the template does (for tests that
    evaluate the admission policy without Helm)."""
    values: dict[str, Any] = {
        "allowedImages": list(policy.allowed_images),
        "allowEngineArgs": policy.allow_engine_args,
        "allowedEngineFlags": list(policy.allowed_engine_flags),
        "allowScheduling": policy.allow_scheduling,
        "allowedPriorityClasses": list(policy.allowed_priority_classes),
    }
    return [{"name": name, "expression": json.dumps(values[name])} for name in VALUE_VARIABLES]


def flag_problem(flag: str) -> str | None:
    """Why ``flag`` cannot be an allowed engine flag (``--allowed-engine-flag``), or None."""
    if not re.fullmatch(r"--?[A-Za-z0-9][-A-Za-z0-9_.]{0,98}", flag):
        return f"{flag!r} is not a flag (-x or --name, letters, digits, '-', '_', '.'; no '=')"
    return None


def prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot be an allowed image prefix (``--allowed-image-prefix``), or None."""
    if not prefix or len(prefix) > 512 or any(c.isspace() or c in '"\\' for c in prefix):
        return (
            f"{prefix!r} is not an image prefix (1 to 512 characters, no whitespace, quotes or backslashes)"
        )
    return None


def unique(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))
