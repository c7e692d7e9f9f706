"""What a sampling rule implies for the token record: whether it truncates, and how many candidates.

One definition, used by the run's resolution (:mod:`mixrl.api.resolve`), the engine's sampler
(:mod:`mixrl.rl.engine.sampling`, which the in-process sampler shares) and the ``/generate``
request builder (:mod:`mixrl.rl.engine.protocol`).  The token record (docs/architecture.md, "The
token record") stores the support S as its leading candidates, so whoever asks an engine for
tokens must know when S exists and how many candidates cover it.

Greedy decoding (temperature 0, as in SGLang) truncates: it samples from S = {the most likely
token}, |S| = 1.  That is what the corrections need: the behaviour distribution of a greedy token
is a point mass, μ(a) = 1, which only a support of one expresses; recording |S| = 0 would claim the
token was drawn from the whole softmax.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

GREEDY_EPS = 1e-6
"""Temperatures below this are greedy decoding."""

UNBOUNDED_VOCAB = sys.maxsize
"""The vocabulary size assumed where it is not known (a client building a request)."""


@dataclass(frozen=True)
class SamplingRule:
    """Temperature and the truncation rules: top-p, top-k (≤ 0: off, SGLang's −1) and min-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def rank_limit(self, vocab_size: int) -> int:
        """How many of the most likely tokens the rank rules keep: 1 when greedy, else top-k (V when off)."""
        if self.greedy:
            return 1
        return vocab_size if self.top_k <= 0 else min(self.top_k, vocab_size)

    def truncates(self, vocab_size: int = UNBOUNDED_VOCAB) -> bool:
        """Whether the rule samples from a support S rather than the whole vocabulary.

        Without ``vocab_size`` any top-k counts as a cut (a client does not know V); with it, a
        top-k of at least V does not.
        """
        return self.rank_limit(vocab_size) < vocab_size or self.top_p < 1.0 or self.min_p > 0.0

    def candidates(self, requested: int) -> int:
        """Candidates K to ask for so that S is among them: at least top-k when a top-k cut bounds S.

        (Without a top-k, |S| is known only after sampling; the torch engine then returns
        max(K, |S|) candidates itself, and SGLang needs a finite top-k for the mask anyway.)
        """
        return max(requested, self.top_k) if self.top_k > 0 else requested

    def mask_limit(self) -> int | None:
        """SGLang's ``--sampling-mask-max-tokens`` for this rule; None leaves SGLang's default.

        SGLang aborts a request whose realised support exceeds the limit, and ties at the top-k
        cut can make the support larger than top-k, so the limit is strictly above the largest
        support the rule allows: twice it (top-k, or 1 when greedy), leaving as many slots again for
        ties.  Without a top-k no limit fits: SGLang aborts a mask request without a finite top-k,
        and the run's validation refuses such a rule on SGLang pools (sglang-mask-needs-top-k).
        """
        if self.greedy:
            bound = 1
        elif self.top_k > 0:
            bound = self.top_k
        else:
            return None
        return MASK_TIE_HEADROOM * bound


MASK_TIE_HEADROOM = 2
"""The mask limit is this many times the largest support a rule allows (strictly above it)."""
