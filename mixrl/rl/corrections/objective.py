"""The corrected objective of docs/corrections.md, one block of positions at a time.

A position's computation has three parts:

1. :func:`vocab_sums` — the only passes over the vocabulary in the forward: the max logit, the
   sampler-unrecorded mass ``Σ_{b∉C} e^{z_b−M}`` and its ``Σ e·(z−M)``, and the logits of the sampled
   token and of the K candidates.  All of it goes through the :class:`VocabShard` seam.
2. :func:`corrected_terms` — per-position arithmetic on those sums and the sampler's record
   (O(K) per position): μ, π, r, w, the centering coefficients, the surrogate and the gradient.
3. :func:`logit_gradient` — the backward's single vocabulary pass: since ∇_z log π(b) = e_b − π,
   the whole gradient is ``coef · (w e_a − c − (w − Σc) π)``: one dense multiple of ``e^{z−M}``
   plus K + 1 sparse entries.  The centering term never needs a per-candidate backward.

Symbols: z logits (divided by temperature), u = z − M, p = softmax(z), q the sampler's
distribution, S the support (the first ``support_size`` candidates), C the recorded candidates,
μ the behaviour distribution, π the trainer's distribution, r = π/μ, w the weight, A the advantage.

The objective's per-token arguments come first in this file: checked once (:func:`prepare_batch`),
then carried as one :class:`~mixrl.rl.corrections.tokens.LossTokens` in the dtypes it computes in.  Every check raises :class:`CorrectionInputError` with one line naming the argument, the first bad
position and the reason.  Values are checked only on loss tokens (``loss_mask`` 1): masked tokens
(tool output, environment text) are ignored entirely, whatever they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mixrl.rl.corrections.config import EXTREME_RATIO_RANGE, CorrectionConfig, CorrectionInputError
from mixrl.rl.corrections.tokens import LossTokens
from mixrl.rl.corrections.vocab import VocabShard

# ---------------------------------------------------------------------- the inputs


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The objective computes in fp32, or in fp64 when given fp64 (the tests' exact checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class PreparedBatch:
    """The checked batch: which rows count in the loss, their records, and the loss denominator."""

    num_tokens: int  # N, every row
    loss_rows: Tensor | None  # [n] indices of the loss rows; None when every row counts
    rows: LossTokens
    """The loss rows' records, in the compute dtype."""
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
    records: object,
    loss_mask: object | None,
    num_loss_tokens: float | None,
    dtype: torch.dtype,
) -> PreparedBatch:
    """Check every field of ``records`` (a :class:`LossTokens`) against the batch size N and the
    vocabulary size V; select the loss rows.

    Floating-point records are converted to ``dtype``, the dtype the objective computes in.
    """
    n = num_tokens
    if n == 0:
        _fail("empty batch: there are no tokens (N = 0)")
    if not isinstance(records, LossTokens):
        _fail(f"tokens must be a LossTokens (the token record as tensors), got {type(records).__name__}")
    assert isinstance(records, LossTokens)
    cand_ids: object = records.cand_ids
    if not isinstance(cand_ids, Tensor) or cand_ids.dim() != 2:
        shape = list(cand_ids.shape) if isinstance(cand_ids, Tensor) else type(cand_ids).__name__
        _fail(f"cand_ids must have shape [N, K] with N = {n}, got {shape}")
    assert isinstance(cand_ids, Tensor)
    k = cand_ids.shape[1]
    tokens = _check_shape("tokens", records.tokens, (n,), integer=True)
    advantages = _check_shape("advantages", records.advantages, (n,), integer=False)
    sampler_logprobs = _check_shape("sampler_logprobs", records.sampler_logprobs, (n,), integer=False)
    cand_ids = _check_shape("cand_ids", cand_ids, (n, k), integer=True)
    cand_logprobs = _check_shape("cand_logprobs", records.cand_logprobs, (n, k), integer=False)
    support_size = _check_shape("support_size", records.support_size, (n,), integer=True)

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

    rows = LossTokens(
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


def _check_values(rows: LossTokens, vocab_size: int, loss_rows: Tensor | None) -> None:
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


# --------------------------------------------------------------------- the objective

_EXP_BLOCK_ELEMENTS = 1 << 20
"""The exponentials of the forward are taken this many elements at a time, so the forward holds
one [rows, V] buffer (the logits) plus a small block, like a plain log-softmax does."""


@dataclass(frozen=True)
class VocabSums:
    """Per-position results of the vocabulary passes, identical on every tensor-parallel rank."""

    shift: Tensor  # [n] M = max_b z_b
    out_mass: Tensor  # [n] Σ_{b∉C} e^{u_b}
    out_dot: Tensor  # [n] Σ_{b∉C} e^{u_b} u_b
    token_logit: Tensor  # [n] u_a
    cand_logits: Tensor  # [n, K] u_c (0 at padding)


def vocab_sums(u: Tensor, rows: LossTokens, shard: VocabShard) -> VocabSums:
    """The forward's vocabulary passes over a block of fp32 logits ``u`` [n, V_shard].

    ``u`` is a scratch buffer the caller owns: it is overwritten (shifted, candidates knocked out).
    """
    shift = shard.all_max(u.amax(dim=1))
    # −inf logits (masked columns) become the most negative finite value: exp gives 0 as before,
    # and 0 · u stays 0 in the entropy's Σ e^u u instead of 0 · (−inf) = NaN.
    u.sub_(shift[:, None]).clamp_(min=torch.finfo(u.dtype).min)
    gathered = torch.cat(
        [shard.local_gather(u, rows.tokens[:, None]), shard.local_gather(u, rows.cand_ids)], 1
    )
    # Knock the recorded candidates out so the sums below run over b ∉ C exactly (no cancellation
    # when the candidates hold almost all the mass); exp(finfo.min) = 0 and 0 · finfo.min = 0.
    flat, _ = shard.flat_positions(rows.cand_ids, rows.valid)
    u.view(-1).index_fill_(0, flat, torch.finfo(u.dtype).min)
    out_mass = torch.empty_like(shift)
    out_dot = torch.empty_like(shift)
    block = max(1, _EXP_BLOCK_ELEMENTS // max(u.shape[1], 1))
    scratch = torch.empty((min(block, u.shape[0]), u.shape[1]), dtype=u.dtype, device=u.device)
    for r0 in range(0, u.shape[0], block):
        ub = u[r0 : r0 + block]
        e = torch.exp(ub, out=scratch[: ub.shape[0]])
        out_mass[r0 : r0 + block] = e.sum(dim=1)
        out_dot[r0 : r0 + block] = e.mul_(ub).sum(dim=1)
    summed = shard.all_sum(torch.cat([out_mass[:, None], out_dot[:, None], gathered], 1).contiguous())
    return VocabSums(shift, summed[:, 0], summed[:, 1], summed[:, 2], summed[:, 3:])


@dataclass(frozen=True)
class CorrectedTerms:
    """Per-position results of the objective for a block of loss positions."""

    loss: Tensor  # [n] this position's share of the loss: −A (w log π(a) − SC) / denominator
    log_ratio: Tensor  # [n] log r(a)
    weight: Tensor  # [n] w(a)
    entropy: Tensor  # [n] H(p)
    # gradient of the loss w.r.t. z (any shift): dense · e^{u} + Σ_k sparse_k e_{c_k} + token · e_a
    shift: Tensor  # [n] M, to recompute e^{u} in the backward
    dense: Tensor  # [n]
    sparse: Tensor  # [n, K]
    token: Tensor  # [n]


def _masked_logsumexp(x: Tensor, keep: Tensor) -> Tensor:
    return torch.logsumexp(x.masked_fill(~keep, float("-inf")), dim=1)


def _weight(r: Tensor, config: CorrectionConfig) -> Tensor:
    """w(r): GRPO 1, TIS min(r, C), MIS r·1[lo ≤ r ≤ hi]."""
    if config.mis is not None:
        lo, hi = config.mis
        return torch.where((r >= lo) & (r <= hi), r, torch.zeros_like(r))
    if config.tis is not None:
        return r.clamp(max=config.tis)
    return torch.ones_like(r)


def _centering_mass(pi: Tensor, mu: Tensor, config: CorrectionConfig) -> Tensor:
    """c(b) = μ(b) w(b), written so that μ = 0 (r = ∞) gives 0 rather than 0·∞.

    MIS: π(b)·1[lo ≤ r(b) ≤ hi]; TIS: min(π(b), C μ(b)); neither: μ(b).
    """
    if config.mis is not None:
        lo, hi = config.mis
        r = pi / mu
        return torch.where((r >= lo) & (r <= hi), pi, torch.zeros_like(pi))
    if config.tis is not None:
        return torch.minimum(pi, config.tis * mu)
    return mu


def _outside_factor(out_mass_p: Tensor, out_mass_q: Tensor, config: CorrectionConfig) -> Tensor:
    """κ with c(b) = κ p(b) for b ∉ C under whole-vocabulary sampling.

    There μ(b) ≈ p(b)(1 − Q_C)/(1 − P_C), so r(b) = r_out = (1 − P_C)/(1 − Q_C) for every b ∉ C and
    c(b) = μ(b) w(r_out) = p(b) · w(r_out)/r_out.  κ = 0 where the trainer puts no mass outside C.
    """
    none_outside = out_mass_p <= 0
    p_out = torch.where(none_outside, torch.ones_like(out_mass_p), out_mass_p)
    if config.mis is not None:
        lo, hi = config.mis
        r_out = p_out / out_mass_q
        kappa = ((r_out >= lo) & (r_out <= hi)).to(p_out.dtype)
    elif config.tis is not None:
        kappa = (config.tis * out_mass_q / p_out).clamp(max=1.0)
    else:
        kappa = out_mass_q / p_out
    return torch.where(none_outside, torch.zeros_like(kappa), kappa)


def corrected_terms(
    sums: VocabSums, rows: LossTokens, config: CorrectionConfig, denominator: float
) -> CorrectedTerms:
    """The objective of docs/corrections.md for each position, from the vocabulary sums and the sampler's record."""
    valid, in_s = rows.valid, rows.in_support
    has_s = rows.support_size > 0
    zero = torch.zeros((), dtype=sums.shift.dtype, device=sums.shift.device)

    # Trainer p on the recorded candidates: e^{u_c}, Z = Σ_b e^{u_b}, log p(c) = u_c − log Z.
    e_c = torch.where(valid, sums.cand_logits.exp(), zero)
    mass = sums.out_mass + e_c.sum(dim=1)
    log_mass = mass.log()
    entropy = log_mass - (sums.out_dot + (e_c * sums.cand_logits).sum(dim=1)) / mass

    # Behaviour μ: q, or q renormalized on S when the token was sampled from a support.
    log_q_s = torch.where(has_s, _masked_logsumexp(rows.cand_logprobs, in_s), zero)
    log_mu_c = rows.cand_logprobs - log_q_s[:, None]
    log_mu_a = rows.sampler_logprobs - log_q_s

    # Trainer π: p, or p renormalized on S under mask replay.
    replay = has_s & config.topp_replay
    log_norm = torch.where(replay, _masked_logsumexp(sums.cand_logits, in_s), log_mass)
    log_pi_c = sums.cand_logits - log_norm[:, None]
    log_pi_a = sums.token_logit - log_norm

    # The sampled token's ratio always uses its own recorded probability.
    log_ratio = log_pi_a - log_mu_a
    weight = _weight(log_ratio.exp(), config)

    # Score centering: c(b) = sg(μ(b) w(b)) over the support (S, or the whole vocabulary).
    centered_slots = torch.where(has_s[:, None], in_s, valid)
    if config.score_centering:
        pi_c = torch.where(centered_slots, log_pi_c.exp(), zero)
        mu_c = torch.where(centered_slots, log_mu_c.exp(), zero)
        c = torch.where(centered_slots, _centering_mass(pi_c, mu_c, config), zero)
        q_out = (-torch.expm1(torch.logsumexp(rows.cand_logprobs, dim=1))).clamp(min=0.0)  # 1 − Q_C
        kappa = torch.where(has_s, zero, _outside_factor(sums.out_mass / mass, q_out, config))
    else:
        c = torch.zeros_like(e_c)
        kappa = torch.zeros_like(mass)
    p_out = sums.out_mass / mass
    c_total = c.sum(dim=1) + kappa * p_out
    # SC = Σ_{c∈C} c log π(c) + κ Σ_{b∉C} p(b) log p(b); the second sum is out_dot/Z − P_out log Z.
    sc_inside = torch.where(c > 0, c * log_pi_c, zero).sum(dim=1)
    sc_outside = torch.where(kappa > 0, kappa * (sums.out_dot / mass - p_out * log_mass), zero)
    surrogate = rows.advantages * (weight * log_pi_a - (sc_inside + sc_outside))

    # d loss / dz = coef · (w e_a − c − (w − Σc) π), coef = −A / denominator.
    coef = -rows.advantages / denominator
    # Replay: π lives on S ⊆ C, so the whole gradient is sparse.  Otherwise π = p = e^{u}/Z is dense,
    # and so is c outside C (κ p).  The candidates' gradient is written whole, over the dense one
    # (logit_gradient): κ is unbounded under score centering alone (1e5 and more where p puts almost
    # nothing outside C), and the dense −κ p and a sparse +κ p put back would cancel in fp32 to
    # within κ·6e-8, wiping the candidates' true gradient out.
    pi_s = torch.where(in_s, log_pi_c.exp(), zero)
    sparse_replay = -c - (weight - c_total)[:, None] * pi_s
    dense = torch.where(replay, zero, -(weight - c_total + kappa) / mass)
    sparse_plain = -c - ((weight - c_total) / mass)[:, None] * e_c
    sparse = torch.where(replay[:, None], sparse_replay, sparse_plain)
    sparse = torch.where(valid, sparse, zero)
    return CorrectedTerms(
        loss=-surrogate / denominator,
        log_ratio=log_ratio,
        weight=weight,
        entropy=entropy,
        shift=sums.shift,
        dense=coef * dense,
        sparse=coef[:, None] * sparse,
        token=coef * weight,
    )


def logit_gradient(z: Tensor, terms: CorrectedTerms, rows: LossTokens, shard: VocabShard) -> Tensor:
    """The loss gradient w.r.t. a block of logits, computed in place in ``z`` (fp32 [n, V_shard])."""
    z.sub_(terms.shift[:, None]).exp_().mul_(terms.dense[:, None])
    flat_c, selected = shard.flat_positions(rows.cand_ids, rows.valid)
    z.view(-1).index_copy_(0, flat_c, terms.sparse[selected])  # the candidates' whole gradient
    flat_a, selected_a = shard.flat_positions(rows.tokens, torch.ones_like(rows.tokens, dtype=torch.bool))
    z.view(-1).index_add_(0, flat_a, terms.token[selected_a])
    return z


def extreme_ratio(log_ratio: Tensor) -> Tensor:
    """1 where r is outside [0.2, 5] (the fixed health range), else 0."""
    lo, hi = EXTREME_RATIO_RANGE
    r = log_ratio.exp()
    return ((r < lo) | (r > hi)).float()
