"""The per-token arguments of the objective: checked once, then carried as one :class:`TokenRows`.

Every check raises :class:`CorrectionInputError` with one line naming the argument, the first bad
position and the reason.  Values are checked only on loss tokens (``loss_mask`` 1): masked tokens
(tool output, environment text) are ignored entirely, whatever they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from mixrl.rl.corrections.config import CorrectionInputError


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The objective computes in fp32, or in fp64 when given fp64 (the tests' exact checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class TokenRows:
    """The sampler's record for the loss tokens, in the dtypes the objective computes in."""

    tokens: Tensor  # [n] int64: sampled ids a
    advantages: Tensor  # [n] compute dtype: A
    sampler_logprobs: Tensor  # [n] fp32: log q(a), untruncated
    cand_ids: Tensor  # [n, K] int64: top-K ids, most likely first, -1 = padding
    cand_logprobs: Tensor  # [n, K] fp32: their log q, -inf at padding
    support_size: Tensor  # [n] int64: |S|, 0 = whole vocabulary

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def valid(self) -> Tensor:
        """[n, K] bool: the slot holds a candidate (not padding)."""
        return self.cand_ids >= 0

    @property
    def in_support(self) -> Tensor:
        """[n, K] bool: the slot's candidate belongs to the sampling support S."""
        k = torch.arange(self.cand_ids.shape[1], device=self.cand_ids.device)
        return k < self.support_size[:, None]

    def take(self, index: slice) -> TokenRows:
        """The rows ``index`` selects, every field alike."""
        return TokenRows(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass(frozen=True)
class PreparedBatch:
    """The checked batch: which rows count in the loss, their records, and the loss denominator."""

    num_tokens: int  # N, every row
    loss_rows: Tensor | None  # [n] indices of the loss rows; None when every row counts
    rows: TokenRows
    denominator: float


def _fail(message: str) -> None:
    raise CorrectionInputError(message)


def _first(bad: Tensor) -> int:
    """Index of the first row where ``bad`` (a [n] or [n, K] bool tensor) holds."""
    if bad.dim() > 1:
        bad = bad.any(dim=1)
    return int(bad.nonzero()[0, 0])


def _check_shape(name: str, x: object, shape: tuple[int, ...], integer: bool) -> Tensor:
    if not isinstance(x, Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    assert isinstance(x, Tensor)
    if tuple(x.shape) != shape:
        _fail(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if integer and (x.is_floating_point() or x.is_complex()):
        _fail(f"{name} must hold integers, got {x.dtype}")
    if not integer and not x.is_floating_point():
        _fail(f"{name} must hold floating-point values, got {x.dtype}")
    return x


def prepare_batch(
    num_tokens: int,
    vocab_size: int,
    tokens: object,
    advantages: object,
    sampler_logprobs: object,
    cand_ids: object,
    cand_logprobs: object,
    support_size: object,
    loss_mask: object | None,
    num_loss_tokens: float | None,
    dtype: torch.dtype,
) -> PreparedBatch:
    """Check every argument against the batch size N and vocabulary size V; select the loss rows.

    Floating-point records are converted to ``dtype``, the dtype the objective computes in.
    """
    n = num_tokens
    if n == 0:
        _fail("empty batch: there are no tokens (N = 0)")
    if not isinstance(cand_ids, Tensor) or cand_ids.dim() != 2:
        shape = list(cand_ids.shape) if isinstance(cand_ids, Tensor) else type(cand_ids).__name__
        _fail(f"cand_ids must have shape [N, K] with N = {n}, got {shape}")
    assert isinstance(cand_ids, Tensor)
    k = cand_ids.shape[1]
    tokens = _check_shape("tokens", tokens, (n,), integer=True)
    advantages = _check_shape("advantages", advantages, (n,), integer=False)
    sampler_logprobs = _check_shape("sampler_logprobs", sampler_logprobs, (n,), integer=False)
    cand_ids = _check_shape("cand_ids", cand_ids, (n, k), integer=True)
    cand_logprobs = _check_shape("cand_logprobs", cand_logprobs, (n, k), integer=False)
    support_size = _check_shape("support_size", support_size, (n,), integer=True)

    loss_rows: Tensor | None = None
    if loss_mask is not None:
        if not isinstance(loss_mask, Tensor) or tuple(loss_mask.shape) != (n,):
            shape = list(loss_mask.shape) if isinstance(loss_mask, Tensor) else type(loss_mask).__name__
            _fail(f"loss_mask must have shape [{n}], got {shape}")
        assert isinstance(loss_mask, Tensor)
        binary = (loss_mask == 0) | (loss_mask == 1)
        if not bool(binary.all()):
            _fail(f"loss_mask[{_first(~binary)}] must be 0 or 1, got {loss_mask[_first(~binary)].item()}")
        keep = loss_mask != 0
        if not bool(keep.all()):
            loss_rows = keep.nonzero().squeeze(1)

    def select(x: Tensor) -> Tensor:
        return x if loss_rows is None else x.index_select(0, loss_rows)

    rows = TokenRows(
        tokens=select(tokens).long(),
        advantages=select(advantages).to(dtype),
        sampler_logprobs=select(sampler_logprobs).to(dtype),
        cand_ids=select(cand_ids).long(),
        cand_logprobs=select(cand_logprobs).to(dtype),
        support_size=select(support_size).long(),
    )
    _check_values(rows, vocab_size, loss_rows)
    rows = replace(rows, cand_logprobs=rows.cand_logprobs.masked_fill(~rows.valid, float("-inf")))
    count = rows.num_rows
    if num_loss_tokens is not None and not num_loss_tokens > 0:
        _fail(f"num_loss_tokens must be positive, got {num_loss_tokens}")
    denominator = float(num_loss_tokens) if num_loss_tokens is not None else float(max(count, 1))
    return PreparedBatch(num_tokens=n, loss_rows=loss_rows, rows=rows, denominator=denominator)


def _check_values(rows: TokenRows, vocab_size: int, loss_rows: Tensor | None) -> None:
    """Value checks on the loss rows; positions in messages index the caller's full batch."""

    def where(i: int) -> int:
        return i if loss_rows is None else int(loss_rows[i])

    def check(bad: Tensor, message: str) -> None:
        if bool(bad.any()):
            i = _first(bad)
            _fail(message.format(i=where(i), row=i))

    if rows.num_rows == 0:
        return
    t, ids, s = rows.tokens, rows.cand_ids, rows.support_size
    k = ids.shape[1]
    check((t < 0) | (t >= vocab_size), f"tokens[{{i}}] is outside the vocabulary [0, {vocab_size})")
    check(~torch.isfinite(rows.advantages), "advantages[{i}] is not finite")
    check(torch.isnan(rows.sampler_logprobs), "sampler_logprobs[{i}] is NaN")
    check(
        ~torch.isfinite(rows.sampler_logprobs),
        "sampler_logprobs[{i}] is infinite (a sampled token must have had positive probability)",
    )
    check((ids < -1) | (ids >= vocab_size), f"cand_ids[{{i}}] holds an id outside [-1, {vocab_size})")
    valid = ids >= 0
    if k > 1:
        check(valid[:, 1:] & ~valid[:, :-1], "cand_ids[{i}] has a candidate after padding (-1 must trail)")
        ordered = torch.where(valid, ids, -1 - torch.arange(k, device=ids.device)).sort(dim=1).values
        check(ordered[:, 1:] == ordered[:, :-1], "cand_ids[{i}] lists the same id twice")
    check(torch.isnan(rows.cand_logprobs) & valid, "cand_logprobs[{i}] holds NaN")
    check((rows.cand_logprobs == float("inf")) & valid, "cand_logprobs[{i}] holds +inf")
    check(s < 0, "support_size[{i}] is negative")
    check(s > k, f"support_size[{{i}}] exceeds the K = {k} candidates")
    check(s > valid.sum(dim=1), "support_size[{i}] exceeds the number of non-padding candidates")
    in_support = torch.arange(k, device=ids.device) < s[:, None]
    inside = ((ids == t[:, None]) & in_support).any(dim=1)
    check((s > 0) & ~inside, "tokens[{i}] is outside its own sampling support (cand_ids[:support_size])")
