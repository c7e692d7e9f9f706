"""What every model of the RLRun and SamplerPool resources shares: the base class and the strict
value types and bounds of their fields (:mod:`mixrl.api.models` for the specs,
:mod:`mixrl.api.status` for the status the operator writes)."""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Strict, model_validator
from pydantic.alias_generators import to_camel

from mixrl.api import rules
from mixrl.api.gpus import GPU_TABLE

INT32_MAX = 2**31 - 1
"""Upper bound of every count: Kubernetes holds replicas (and the int32s of its APIs) in 32 bits, so a
larger maxReplicas would reach a Deployment or the scale subresource wrapped or refused."""
MAX_GPUS_PER_POD = 64
"""GPUs of one engine replica or one trainer node: one pod's GPUs, on one node (the largest nodes
have 8 to 16). It also keeps the GPU-budget rule's sum far from int64 in the API server's CEL."""
MAX_CAPACITY = 1e6
"""Relative capacities and prices are summed and multiplied by the router and the autoscaler; a
finite but astronomical value would overflow those sums to inf and the shares to NaN."""
MAX_SECONDS = 7 * 24 * 3600.0
"""Longest interval or window (a week); asyncio's timers overflow on far larger values."""

Int = Annotated[int, Strict()]
"""An integer that must be written as one: pydantic's lax mode would read YAML's ``true`` as 1,
``"8"`` as 8 and ``1e20`` (a string to PyYAML) as an integer."""
Float = Annotated[float, Strict()]
"""A number: integers are fine, booleans and strings are not (never inf or NaN: see Model)."""
Bool = Annotated[bool, Strict()]
"""true or false: pydantic's lax mode would also take 1, 0 and strings like "off"."""


class Model(BaseModel):
    """Base: camelCase names outside, unknown fields rejected (typos must not pass silently), and
    floats finite: an ``.inf`` capacity would make the router's shares NaN, an ``.inf`` lr NaN weights."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Self:
        # every rule of mixrl.api.rules that names this model, as the CRDs' CEL checks it
        rules.enforce(self, GPU_TABLE)
        return self

    def to_yaml_dict(self) -> dict[str, Any]:
        """camelCase dict without unset optional fields, as a user would write it."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
