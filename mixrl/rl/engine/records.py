"""Token records from an SGLang-shaped ``/generate`` response (pure; no I/O).

Works on the torch engine's responses and on a real SGLang server's: only SGLang's standard fields
are required (``output_ids``, ``meta_info.output_token_logprobs``); mixrl's extra fields refine them
when present:

- ``output_token_weight_versions`` (per token); else ``meta_info.weight_version`` for every token
  (SGLang reports one version per request; SGLang's initial version string ``"default"`` reads as 0);
- ``output_token_support_size`` (per token); else ``len(output_token_sampling_mask[t])``; else 0.

Candidates are the position's ``output_top_logprobs``.  When a support S is known, its members are put
first (most likely first), so S is always the leading ``support_size`` candidates as the token record
requires; a support member whose log-prob the response does not carry is an error (ask for
``top_logprobs_num >= top_k``, which :class:`EngineClient` does).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from mixrl.api.trajectory import TokenRecord


class EngineResponseError(ValueError):
    """An engine response that does not hold what a token record needs."""


def parse_weight_version(value: Any) -> int:
    """SGLang's weight_version string as mixrl's integer version."""
    if isinstance(value, bool):
        raise EngineResponseError(f"weight_version: expected an integer version, got {value!r}")
    if isinstance(value, int):
        return value
    if value in (None, "default"):
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise EngineResponseError(f"weight_version: expected an integer version, got {value!r}") from None


def _candidates(
    top: list[Any] | None, token_id: int, logprob: float, mask: list[int] | None
) -> tuple[list[int], list[float]]:
    known: dict[int, float] = {}
    for entry in top or []:
        known.setdefault(int(entry[1]), float(entry[0]))
    ordered = sorted(known.items(), key=lambda kv: -kv[1])
    if not mask:
        return [i for i, _ in ordered], [lp for _, lp in ordered]
    known.setdefault(token_id, logprob)
    missing = [i for i in mask if i not in known]
    if missing:
        raise EngineResponseError(
            f"output_top_logprobs: support member {missing[0]} has no log-prob; request "
            f"top_logprobs_num >= top_k so the top candidates cover the sampling support"
        )
    members = set(mask)
    head = sorted(((i, known[i]) for i in members), key=lambda kv: -kv[1])
    tail = [(i, lp) for i, lp in sorted(known.items(), key=lambda kv: -kv[1]) if i not in members]
    merged = head + tail
    return [i for i, _ in merged], [lp for _, lp in merged]


def token_records(response: dict[str, Any]) -> list[TokenRecord]:
    """One :class:`TokenRecord` per generated token of a single-prompt response."""
    meta = response.get("meta_info") or {}
    output_ids = response.get("output_ids")
    token_lps = meta.get("output_token_logprobs")
    if output_ids is None or token_lps is None:
        raise EngineResponseError("output_token_logprobs: missing; the request must set return_logprob")
    n = len(output_ids)
    if len(token_lps) != n:
        raise EngineResponseError(f"output_token_logprobs: {len(token_lps)} entries for {n} output tokens")
    tops = meta.get("output_top_logprobs") or [None] * n
    masks = meta.get("output_token_sampling_mask")
    sizes = meta.get("output_token_support_size")
    versions = meta.get("output_token_weight_versions")
    if versions is None:
        versions = [parse_weight_version(meta.get("weight_version"))] * n
    records: list[TokenRecord] = []
    for t in range(n):
        logprob, token_id = float(token_lps[t][0]), int(token_lps[t][1])
        if token_id != output_ids[t]:
            raise EngineResponseError(
                f"output_token_logprobs[{t}]: token {token_id} != output_ids {output_ids[t]}"
            )
        mask = masks[t] if masks is not None else None
        support = int(sizes[t]) if sizes is not None else len(mask or [])
        if support and mask is None:
            # the engine told |S| without its members: they are the leading candidates by definition
            top_ids = [int(e[1]) for e in sorted(tops[t] or [], key=lambda e: -float(e[0]))]
            if len(top_ids) < support:
                raise EngineResponseError(
                    f"output_top_logprobs[{t}]: {len(top_ids)} candidates for a support of {support}; "
                    "request return_sampling_mask"
                )
            mask = top_ids[:support]
        cand_ids, cand_lps = _candidates(tops[t], token_id, logprob, mask if support else None)
        try:
            records.append(
                TokenRecord(
                    token_id=token_id,
                    logprob=logprob,
                    cand_ids=cand_ids,
                    cand_logprobs=cand_lps,
                    support_size=support,
                    weight_version=parse_weight_version(versions[t]),
                )
            )
        except ValidationError as exc:
            message = exc.errors()[0].get("msg", str(exc))
            raise EngineResponseError(f"token {t}: {message}") from None
    return records
