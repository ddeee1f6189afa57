"""Sampling math for lossless speculative decoding (Leviathan et al. 2023, sections 2.2-2.3).

Pure functions of tensors. Every random draw takes an explicit ``torch.Generator``; nothing here
touches the global RNG. Notation, everywhere: ``p`` = target distribution, ``q`` = draft distribution.

Temperature, top-k and top-p are folded into one *adjusted distribution* (``logits_to_probs``,
Leviathan 2.2). Speculative sampling is lossless with respect to that adjusted ``p``; ``q`` must be
the distribution the draft token was really sampled from (adjusted the same way or not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SamplingParams",
    "accept_chain",
    "accept_chain_greedy",
    "logits_to_probs",
    "residual",
    "sample",
    "verify_chain",
    "verify_chain_greedy",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the adjusted distribution that is sampled from.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep only the k highest logits; 0 disables.
    top_p: nucleus; keep the smallest set of most likely tokens with mass >= top_p; 1 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature={t!r} is invalid: allowed range is a finite number >= 0 (0 = greedy)"
            )
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k={k!r} is invalid: allowed range is an integer >= 0 (0 = off)")
        tp = self.top_p
        if isinstance(tp, bool) or not isinstance(tp, (int, float)) or not 0.0 < tp <= 1.0:
            raise ValueError(f"top_p={tp!r} is invalid: allowed range is 0 < top_p <= 1 (1 = off)")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0


def _keep_top_k(logits: Tensor, k: int) -> Tensor:
    """Set all but the k largest logits to -inf. logits: [..., V] -> [..., V]."""
    k = min(k, logits.shape[-1])
    idx = torch.topk(logits, k, dim=-1).indices  # [..., k]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)  # [..., V]
    return logits.masked_fill(~keep, float("-inf"))


def _keep_top_p(probs: Tensor, top_p: float) -> Tensor:
    """Keep the minimal nucleus with mass >= top_p (at least one token), renormalised.

    probs: [..., V] -> [..., V]. A token is kept iff the mass strictly before it (in descending
    order) is < top_p, which is exactly the smallest prefix whose cumulative mass reaches top_p.
    """
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True, stable=True)  # [..., V] x2
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [..., V]
    keep_sorted = mass_before < top_p  # [..., V]
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, idx, keep_sorted)  # [..., V]
    kept = probs.masked_fill(~keep, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Adjusted distribution (float32) from logits: greedy one-hot, or temperature -> top-k -> top-p.

    logits: [..., V] -> probs: [..., V], rows sum to 1. Greedy ties go to the lowest index
    (``torch.argmax``).
    """
    logits = logits.float()  # [..., V]
    vocab = logits.shape[-1]
    if params.greedy:
        top = torch.argmax(logits, dim=-1)  # [...]
        return torch.nn.functional.one_hot(top, vocab).to(torch.float32)
    scaled = logits / params.temperature  # [..., V]
    if params.top_k > 0:
        scaled = _keep_top_k(scaled, params.top_k)
    probs = torch.softmax(scaled, dim=-1)  # [..., V]
    if params.top_p < 1.0:
        probs = _keep_top_p(probs, params.top_p)
    return probs


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Draw one token per row. probs: [V] -> [] (long) or [N, V] -> [N] (long)."""
    if probs.dim() not in (1, 2):
        raise ValueError(f"probs must have shape [V] or [N, V], got {tuple(probs.shape)}")
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """Resampling distribution after a rejection: norm(max(0, p - q)). p, q: [..., V] -> [..., V].

    If a row's residual mass is zero then p <= q everywhere, and since both sum to 1, p == q
    (up to float error). Then every drafted token x (q(x) > 0) is accepted with probability
    min(1, p(x)/q(x)) = 1, so a rejection — and this call — happens with probability zero under
    exact arithmetic; any distribution would keep the output exact. We return p, the choice that
    stays correct when rounding makes a rejection happen anyway (p ~= q, so the output is ~p).
    """
    diff = torch.clamp(p - q, min=0.0)  # [..., V]
    mass = diff.sum(dim=-1, keepdim=True)  # [..., 1]
    safe = torch.where(mass > 0, mass, torch.ones_like(mass))
    return torch.where(mass > 0, diff / safe, p)


def reuse_or_draw(q: Tensor, proposed: int, generator: torch.Generator) -> tuple[int, bool]:
    """A token distributed exactly as ``q`` ``[V]`` that reuses ``proposed`` where it can: keep it with
    probability ``q(proposed)``, else draw from ``q`` with ``proposed`` removed (renormalised) ->
    ``(token, kept)``. P(proposed) = q(proposed) and P(x) = (1 - q(proposed)) q(x) / (1 - q(proposed))
    = q(x) otherwise: speculative sampling with a one-hot draft and ``q`` as the target. How a draft
    model checks a prompt-lookup copy without changing the distribution it drafts from. A greedy
    (one-hot) ``q`` keeps ``proposed`` exactly when it is ``q``'s argmax, with no random draw."""
    top = int(torch.argmax(q))
    if float(q[top]) >= 1.0:  # one-hot (greedy): deterministic
        return top, top == proposed
    q_c = float(q[proposed])
    if q_c > 0.0 and float(torch.rand((), generator=generator, device=q.device)) < q_c:
        return proposed, True
    rest = q.clone()
    rest[proposed] = 0.0
    return int(sample(rest / rest.sum(), generator)), False


def _check_chain_shapes(p: Tensor, q: Tensor | None, draft_tokens: Tensor) -> int:
    """Validate verify_chain inputs; return k (number of draft tokens)."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must have shape [k], got {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must have shape [k+1, V] = [{k + 1}, V], got {tuple(p.shape)}")
    if q is not None and tuple(q.shape) != (k, p.shape[1]):
        raise ValueError(f"q must have shape [k, V] = [{k}, {p.shape[1]}], got {tuple(q.shape)}")
    return k


def accept_chain(p: Tensor, q: Tensor | None, draft_tokens: Tensor, generator: torch.Generator) -> Tensor:
    """Leviathan Algorithm 1 on the device, with no host read: -> ``[k + 2]`` long, ``(n, t_0 ..
    t_k)`` where ``n`` drafts were accepted and ``t_0 .. t_n`` are the tokens the round appends
    (``t_i`` = draft ``i`` for ``i < n``, then the residual or bonus draw; entries past ``n`` are
    padding). The decode loop reads it back once. Inputs as in :func:`verify_chain`, unchecked
    (validation reads the device; :func:`verify_chain` does it)."""
    k = draft_tokens.shape[0]
    draft_tokens = draft_tokens.to(device=p.device, dtype=torch.long)
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft_tokens]  # [k]
    q_x = torch.ones_like(p_x) if q is None else q[rows, draft_tokens]  # [k] (one-hot: q(x) = 1)
    u = torch.rand(k, generator=generator, device=p.device, dtype=p_x.dtype)  # [k]
    n = torch.cumprod((u * q_x < p_x).long(), dim=0).sum()  # accepted prefix: u < p/q, without dividing
    # q's row at the first rejection; after k acceptances none (residual(p[k], 0) = p[k], the bonus)
    if k == 0:
        q_n = torch.zeros_like(p[0])
    elif q is None:
        q_n = torch.nn.functional.one_hot(draft_tokens[n.clamp(max=k - 1)], p.shape[1]).to(p.dtype) * (n < k)
    else:
        q_n = q[n.clamp(max=k - 1)] * (n < k)
    nxt = torch.multinomial(residual(p[n], q_n), 1, generator=generator)  # [1]
    kept = torch.cat([draft_tokens, nxt])
    out = torch.where(torch.arange(k + 1, device=p.device) < n, kept, nxt)  # [k+1]
    return torch.cat([n[None], out])


def accept_chain_greedy(target_argmax: Tensor, draft_tokens: Tensor) -> Tensor:
    """Greedy verification on the device -> ``[k + 2]`` long ``(n, argmax_0 .. argmax_k)``: the
    accepted prefix is where the draft equals the target argmax, and the appended tokens are
    ``argmax_0 .. argmax_n`` (equal to the accepted drafts, then the target's next token)."""
    k = draft_tokens.shape[0]
    match = draft_tokens.to(target_argmax.device) == target_argmax[:k]  # [k]
    n = torch.cumprod(match.long(), dim=0).sum()
    return torch.cat([n[None], target_argmax])


def verify_chain(
    p: Tensor,
    q: Tensor | None,
    draft_tokens: Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Leviathan Algorithm 1: verify a chain of k draft tokens against the target.

    p: [k+1, V] target distributions at each draft position plus the bonus position.
    q: [k, V] draft distributions the tokens were sampled from, or None for a deterministic draft
       (q one-hot at each draft token: accept with prob p[i, x], resample from p with x removed).
    draft_tokens: [k] long.
    Token i is accepted with probability min(1, p[i, x] / q[i, x]); at the first rejection the next
    token is drawn from residual(p[i], q[i]); if all k are accepted a bonus token is drawn from p[k].
    Returns (number accepted, next token id). The output is distributed exactly as sampling from p.
    Checked inputs; the decode loop runs :func:`accept_chain` itself (no host reads).
    """
    k = _check_chain_shapes(p, q, draft_tokens)
    draft_tokens = draft_tokens.to(device=p.device, dtype=torch.long)
    if q is not None:
        q_x = q[torch.arange(k, device=p.device), draft_tokens]  # [k]
        bad = torch.nonzero(q_x <= 0)
        if bad.numel() > 0:
            i = int(bad[0, 0])
            raise ValueError(
                f"q[{i}, {int(draft_tokens[i])}] = 0: draft token {int(draft_tokens[i])} at position {i}"
                " could not have been sampled from q; pass the distribution the draft actually sampled"
                " from, or q=None for a deterministic (greedy) draft"
            )
    out = accept_chain(p, q, draft_tokens, generator).tolist()
    return out[0], out[1 + out[0]]


def verify_chain_greedy(target_argmax: Tensor, draft_tokens: Tensor) -> tuple[int, int]:
    """Greedy verification: accept the longest prefix where the draft equals the target argmax.

    target_argmax: [k+1] long, draft_tokens: [k] long. Returns (accepted, target_argmax[accepted]).
    """
    k = draft_tokens.shape[0]
    if target_argmax.dim() != 1 or target_argmax.shape[0] != k + 1:
        raise ValueError(
            f"target_argmax must have shape [k+1] = [{k + 1}], got {tuple(target_argmax.shape)}"
        )
    out = accept_chain_greedy(target_argmax, draft_tokens).tolist()
    return out[0], out[1 + out[0]]
