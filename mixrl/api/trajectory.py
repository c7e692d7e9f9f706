"""The token record and the trajectory: one definition every component uses.

The sampler (:func:`mixrl.rl.engine.sampling.sample_rows`, in the engine and in-process) makes a
:class:`TokenRecord` per generated token; the wire module (:mod:`mixrl.rl.engine.protocol`) carries
it through ``/generate`` and reads it back; the rollout appends it, plus loss-masked tool/environment
tokens, to a :class:`Trajectory`; the buffer stores trajectories as JSON lines; the trainer turns a
batch of them into tensors (:func:`mixrl.rl.trainer.batch.collate`).  The trainer never re-tokenizes
text: ``prompt_ids`` + ``tokens`` is exactly the sequence the engines saw.  The fields and their
meaning: docs/architecture.md, "The token record".
"""

from __future__ import annotations

import math
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

NO_VERSION = -1
"""weight_version of tokens no sampler produced (tool output, environment text)."""


class TokenRecord(BaseModel):
    """What the sampler knew when it produced one token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int = Field(ge=0, description="The sampled token id a_t.")
    logprob: float = Field(
        description="log q(a_t): the sampler's untruncated log-probability after temperature "
        "(SGLang's output_token_logprobs)."
    )
    cand_ids: list[int] = Field(
        default_factory=list, description="The sampler's K most likely token ids, most likely first."
    )
    cand_logprobs: list[float] = Field(
        default_factory=list, description="log q of each candidate, same distribution as logprob."
    )
    support_size: int = Field(
        default=0,
        ge=0,
        description="How many leading candidates formed the sampling support S (top-p ∩ top-k ∩ "
        "min-p; greedy decoding: 1); 0 = sampled from the whole vocabulary.",
    )
    weight_version: int = Field(ge=0, description="Weight version of the sampler that produced the token.")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(self.cand_ids) != len(self.cand_logprobs):
            raise ValueError("cand_ids and cand_logprobs must have the same length")
        if self.support_size > len(self.cand_ids):
            raise ValueError(f"support_size {self.support_size} exceeds the {len(self.cand_ids)} candidates")
        if self.support_size and self.token_id not in self.cand_ids[: self.support_size]:
            raise ValueError(f"sampled token {self.token_id} is outside its own support")
        if math.isnan(self.logprob):
            raise ValueError("logprob is NaN")
        return self


class Trajectory(BaseModel):
    """One episode: the prompt and every later token, columnar (one entry per token after the prompt).

    Generated tokens carry their sampler's record; tool/environment tokens have ``loss_mask`` 0,
    ``logprob`` 0, no candidates and ``weight_version`` :data:`NO_VERSION`.
    """

    # Strict: "7", 7.0 and true are not token ids, "0.5" is not a log-probability.
    model_config = ConfigDict(extra="forbid", strict=True)

    run: str = Field(default="", description="RLRun name.")
    prompt_id: str = Field(
        description="Identifies the task; trajectories with the same prompt_id form a group."
    )
    sample_index: int = Field(default=0, ge=0, description="Index of this sample within its group.")
    pool: str = Field(description="Sampler pool that generated this episode (sessions stay on one pool).")
    gpu_type: str = Field(default="", description="GPU type of that pool.")
    precision: str = Field(default="", description="Weight precision of that pool.")
    prompt_ids: list[int] = Field(description="Token ids of the initial prompt (never trained on).")
    tokens: list[int] = Field(default_factory=list, description="Every token after the prompt.")
    loss_mask: list[int] = Field(default_factory=list, description="1 for sampled tokens, 0 for tool output.")
    logprobs: list[float] = Field(default_factory=list, description="Sampler log q(token); 0 where masked.")
    cand_ids: list[list[int]] = Field(default_factory=list, description="Per token, the sampler's top-K ids.")
    cand_logprobs: list[list[float]] = Field(default_factory=list, description="Per token, their log q.")
    support_size: list[int] = Field(
        default_factory=list, description="Per token, |S| (0 = whole vocabulary)."
    )
    weight_version: list[int] = Field(default_factory=list, description="Per token, the producing version.")
    reward: float | None = Field(default=None, description="Episode reward, set when the episode ends.")
    finish_reason: str = Field(
        default="",
        description="submitted | max_turns | context_limit | format_errors | aborted",
    )
    num_turns: int = Field(default=0, ge=0, description="Assistant turns taken.")
    split: str = Field(default="train", description="train or heldout.")

    @model_validator(mode="after")
    def _columns_align(self) -> Self:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "cand_ids", "cand_logprobs", "support_size", "weight_version"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        return self

    def append_generated(self, record: TokenRecord) -> None:
        """Append one sampled token with everything its sampler recorded."""
        self.tokens.append(record.token_id)
        self.loss_mask.append(1)
        self.logprobs.append(record.logprob)
        self.cand_ids.append(list(record.cand_ids))
        self.cand_logprobs.append(list(record.cand_logprobs))
        self.support_size.append(record.support_size)
        self.weight_version.append(record.weight_version)

    def append_observation(self, token_ids: list[int]) -> None:
        """Append tool or environment tokens: kept in the context, masked out of the loss."""
        k = len(token_ids)
        self.tokens.extend(token_ids)
        self.loss_mask.extend([0] * k)
        self.logprobs.extend([0.0] * k)
        self.cand_ids.extend([] for _ in range(k))
        self.cand_logprobs.extend([] for _ in range(k))
        self.support_size.extend([0] * k)
        self.weight_version.extend([NO_VERSION] * k)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def oldest_version(self) -> int:
        """The oldest weight version among generated tokens (NO_VERSION if none)."""
        versions = [v for v, m in zip(self.weight_version, self.loss_mask, strict=True) if m]
        return min(versions) if versions else NO_VERSION


JSON_NUMBER_BYTES = 26
"""Most bytes one number takes in a JSON body: the longest float64 repr (``-2.2250738585072014e-308``,
24 characters), its comma and the space Python's encoder puts after it."""
JSON_TRAJECTORY_OVERHEAD = 64 << 10
"""Bytes of a trajectory's fixed fields (names, ids, reward, split; each capped far below this)."""


def largest_json_bytes(context_tokens: int, candidates: int) -> int:
    """An upper bound on one trajectory's JSON size when its context holds ``context_tokens``
    tokens with ``candidates`` candidates recorded per generated token.

    Every context token appears once (``prompt_ids`` or ``tokens``), and at most it also has a loss
    mask, a log q, a support size, a weight version and ``candidates`` ids and log q's, each list
    with its brackets.  The buffer derives its request limit from this, so a real group always
    fits and a body of gigabytes is refused before it is read whole."""
    numbers_per_token = 5 + 2 * candidates
    brackets_per_token = 8  # the two candidate lists: "[", "]", ", " each
    return (
        context_tokens * (numbers_per_token * JSON_NUMBER_BYTES + brackets_per_token)
        + JSON_TRAJECTORY_OVERHEAD
    )
