"""A drafting model's chain round (``ChainDrafter``): one token per depth. Without a confidence
threshold and without a copy to check it is the static shape of width 1 (picked on the device,
nothing read back); otherwise one host read per depth decides whether to go on."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.draft import Draft, DraftSteps, Forward
from runtime.draft_rounds import DraftHost, propose_static
from runtime.draft_shapes import TreeShape, pad_vocab
from runtime.sampling import SamplingParams, logits_to_probs, reuse_or_draw, sample


class ChainDrafter:
    """Proposes chains; ``copied_kept`` counts copied tokens its check kept (draft forwards saved)."""

    def __init__(self) -> None:
        self.copied_kept = 0

    def propose(
        self, host: DraftHost, shape: TreeShape, k: int, params: SamplingParams, gen: torch.Generator,
        copy: Sequence[int] = (),
    ) -> DraftSteps:
        """Draft up to ``min(k, depth of shape)`` tokens; with ``copy`` (a lookup copy) each copied
        token is kept while the model would have drafted it (``reuse_or_draw``), and the model drafts
        on from the first it would not have: greedy, token for token the chain it drafts alone."""
        depth_max = min(k, len(shape.widths))
        if not copy and shape.threshold <= 0:
            logits = yield from host.catch_up(len(shape.widths))  # [1, Vd]
            host.round.base = host.cache.length
            return (yield from propose_static(host, (1,) * depth_max, logits, params, gen))
        return (yield from self._propose_read(host, shape, depth_max, list(copy[:depth_max]), params, gen))

    def _propose_read(
        self, host: DraftHost, shape: TreeShape, depth_max: int, copy: list[int], params: SamplingParams,
        gen: torch.Generator,
    ) -> DraftSteps:
        """Depth by depth with a host read: a threshold stop, and the check of ``copy``. One forward
        runs the pending tokens and the copy; from the first depth where the copied token is not
        kept, the copy's rows are rolled back and the model drafts on one forward per depth."""
        rows = yield from host.catch_up(len(shape.widths), copy)  # [len(copy) + 1, Vd]
        rnd = host.round
        rnd.base = host.cache.length - len(copy)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        logits = rows[0]
        copying = True
        for depth in range(depth_max):
            if depth > 0 and shape.threshold > 0 and float(torch.softmax(logits, -1).max()) < shape.threshold:
                break
            copied = copy[depth] if copying and depth < len(copy) else None
            if params.greedy:  # the argmax, kept where the copy has it: no one-hot over the vocabulary
                tok = int(torch.argmax(logits))
                kept = copied == tok
            else:
                q = logits_to_probs(logits, params)  # [Vd]
                qs.append(q)
                if copied is not None and copied < q.shape[-1]:
                    tok, kept = reuse_or_draw(q, copied, gen)
                else:
                    tok, kept = int(sample(q, gen)), False
            tokens.append(tok)
            if kept:  # its row is the copy's: the next depth's logits are already computed
                rnd.slot[depth] = depth
                self.copied_kept += 1
                logits = rows[depth + 1]
                continue
            if copying:
                copying = False
                host.cache.rollback(rnd.base + depth)  # the copy's rows from here on are not the draft's
            if depth + 1 == depth_max:
                break
            logits = (yield Forward(host.model, torch.tensor([tok], device=host.model.device), host.cache,
                                    plan=host.plan)).float()[0]
            rnd.slot[depth] = depth
        host.cache.rollback(rnd.base + len(rnd.slot))  # kept copy rows past a threshold stop
        q_all = None if params.greedy else pad_vocab(torch.stack(qs), host.target_vocab)
        parents = tuple(range(-1, len(tokens) - 1))  # a chain as a tree, as the static proposal gives it
        return Draft(torch.tensor(tokens, dtype=torch.long, device=host.model.device), q_all, parents)
