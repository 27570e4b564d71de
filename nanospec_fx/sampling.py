"""Speculative sampling rules that stay lossless with a pruned drafter.

A nanospec drafter's logits are ``-inf`` outside the active vocabulary, so its draft distribution
``q`` is zero there. Speculative sampling keeps the target's distribution ``p`` exactly for *any*
``q`` as long as three things hold, and :class:`SpeculativeSampler` is written around them:

1. the ``q`` used to accept a draft token is the distribution the token was really drawn from
   (the pruned one: :meth:`SpeculativeSampler.draft_probs` is used for both);
2. acceptance compares ``u * q(x) < p(x)`` (no division, so no ``0/0``; a drawn ``x`` has
   ``q(x) > 0``);
3. after a rejection the next token comes from the normalised ``max(p - q, 0)`` over the **whole**
   vocabulary: tokens outside the active set, where ``q = 0``, keep all of their target mass
   there. That is how tokens the drafter cannot propose are still generated at the right rate.

Several candidates per position (a draft tree) use recursive rejection sampling (SpecInfer,
EAGLE; Jeon et al. 2024): the candidates are drawn *without replacement* from ``q`` (Gumbel top-k),
and each rejection moves ``p`` to the residual and removes the rejected token from ``q``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpeculativeSampler:
    """Temperature / top-k / top-p sampling and the speculative accept and residual rules.

    ``top_k=0`` and ``top_p=1.0`` turn those filters off. The same warping is applied to the
    target's and to the drafter's logits (any drafter distribution keeps the output lossless; a
    drafter warped like the target is accepted more often). Tokens with ``-inf`` logits (inactive
    under nanospec, or filtered) get probability exactly 0.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r} (use greedy decoding for 0)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")

    # ------------------------------------------------------------------ distributions
    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits after temperature, top-k and top-p (as transformers' warpers, in that order)."""
        z = logits.float() / self.temperature
        if self.top_k and self.top_k < z.shape[-1]:
            kth = z.topk(self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_z, order = z.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
            cumulative = sorted_z.softmax(-1).cumsum(-1)
            remove = cumulative <= 1 - self.top_p
            remove[..., -1] = False  # always keep the most likely token
            z = z.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        return z

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution of ``logits [..., V]``: softmax of :meth:`warp`."""
        return self.warp(logits).softmax(-1)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``q``: the distribution draft tokens are drawn from *and* verified against."""
        return self.probs(logits)

    # ------------------------------------------------------------------ drawing
    def draw(self, q: torch.Tensor, k: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` tokens drawn without replacement from each row of ``q [..., V]`` (Gumbel top-k), in draw order.

        Returns ``(tokens [..., k], exists [..., k])``; ``exists`` is False where ``q`` has fewer
        than ``k`` tokens of positive probability (those tokens are arbitrary).
        """
        noise = torch.empty_like(q, dtype=torch.float32).exponential_(generator=generator)
        keys = q.float().log() - noise.log()  # log q + Gumbel; -inf where q = 0
        values, tokens = keys.topk(k, dim=-1)
        return tokens, torch.isfinite(values)

    def sample(self, p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """One token from each row of ``p [..., V]``."""
        flat = p.reshape(-1, p.shape[-1]).float()
        return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])

    # ------------------------------------------------------------------ verifying
    def accept(self, p_x: torch.Tensor, q_x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Accept a token drawn from ``q`` with probability ``min(1, p(x) / q(x))``."""
        u = torch.rand(p_x.shape, generator=generator, device=p_x.device, dtype=torch.float64)
        return u * q_x.double() < p_x.double()

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The distribution after a rejection: ``max(p - q, 0)`` normalised, over the whole vocabulary.

        It has no mass only when ``p == q`` (up to rounding), where a rejection has probability 0;
        ``p`` is returned then, so a rounding-error rejection never gives NaN.
        """
        r = (p.double() - q.double()).clamp_min(0)
        total = r.sum(-1, keepdim=True)
        return torch.where(total > 0, r / total.clamp_min(torch.finfo(torch.float64).tiny), p.double()).to(p.dtype)

    def verify(self, p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor,
               generator: torch.Generator | None = None) -> tuple[int, int]:
        """One position: recursive rejection sampling over ``candidates`` drawn without replacement from ``q``.

        ``p``, ``q``: ``[V]`` target and draft distributions; ``candidates [m]`` in draw order
        (``m = 0``: just sample from ``p``). Returns ``(index of the accepted candidate or -1, token)``;
        the token is distributed exactly as ``p``.
        """
        p, q = p.double(), q.double()
        for i, x in enumerate(candidates.tolist()):
            if bool(self.accept(p[x], q[x], generator)):
                return i, x
            p = self.residual(p, q)
            q = q.clone()
            q[x] = 0.0
            total = q.sum()
            if total <= 0:  # every token q could propose was tried
                break
            q = q / total
        return -1, int(self.sample(p, generator))


__all__ = ["SpeculativeSampler"]
