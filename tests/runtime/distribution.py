"""A harness that checks speculative sampling reproduces the target's distribution exactly.

The reference is exact: the joint distribution of the first ``LENGTH`` generated tokens after a
prompt, computed by enumerating every prefix with the target alone (``V^2 + V + 1`` forwards
for three tokens), adjusted by the same :class:`SamplingParams` the decoder samples with.

The empirical side decodes the prompt once per seed with the real :class:`Decoder` and counts
the token tuples; a chi-square test compares counts with the exact probabilities (rare cells
pooled so every expected count is >= ``MIN_EXPECTED``; a sampled cell of probability zero is a
failure of its own). Seeds are fixed, so a run is reproducible.

A check is only worth something when it (a) exercises what it claims -- :func:`check_speculated`
asserts from the decode stats that drafts were made, rejected and accepted to depth >= 2 -- and
(b) can fail: ``test_distribution.py`` runs this same harness with deliberately wrong acceptance
rules and asserts the chi-square rejects them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy.stats import chisquare

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import Draft, ModelDrafter, TreeShape
from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams, logits_to_probs
from runtime.stats import DecodeStats
from runtime.testing import tiny_model
from runtime.transformer import CausalLM
from runtime.tree import compile_tree
from search_spaces.layer_plan import LayerPlan

V = 5  # vocabulary: 125 joint cells for three tokens
LENGTH = 3  # generated tokens whose joint distribution is checked
PROMPT = [1, 3, 0, 2, 4, 1]
# head scale of the tiny models: the target's next-token entropy is about 1.2 nats (of ln 5 = 1.6)
# and an independently seeded 1-layer draft accepts about 0.45 of its tokens as a chain
SHARPEN = 6.0
N_SEEDS = 1000
MIN_EXPECTED = 5.0
ALPHA = 1e-3  # the chi-square rejects below this p-value

Cell = tuple[int, ...]  # the first LENGTH generated tokens
Exact = dict[Cell, float]  # every cell's probability under the target (zeros included)


# ------------------------------------------------------------------ models and decoders
def spread_model(seed: int, layers: int = 2, family: str = "llama", sharpen: float = SHARPEN) -> torch.nn.Module:
    """A tiny random model over ``V`` tokens whose sampled distributions are spread (no near-ties
    to one token), so that drafts are accepted sometimes and rejected sometimes."""
    return tiny_model(family, seed, vocab=V, layers=layers, sharpen=sharpen)


def model_decoder(
    target: CausalLM, draft: CausalLM, shape: TreeShape, plan: LayerPlan | None = None, calibrate: bool = True
) -> Decoder:
    """A draft-model decoder whose verify pass is padded to the shape's full tree."""
    drafter = ModelDrafter(draft, target.dims.vocab, shape, plan=plan, calibrate=calibrate)
    return Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1)


def first_round_config(depth: int, params: SamplingParams, seed: int) -> GenerationConfig:
    """Generation budget that lets the first speculative round draft to ``depth``: after the
    prefill's token, the decoder caps a round's draft at ``max_new_tokens - 2``."""
    return GenerationConfig(max_new_tokens=depth + 2, sampling=params, seed=seed)


# ------------------------------------------------------------------ exact reference
def exact_joint(target: CausalLM, prompt: list[int], params: SamplingParams, length: int = LENGTH) -> Exact:
    """P(t_1..t_length | prompt) under the target alone, for every token tuple (zeros included)."""
    vocab = target.dims.vocab

    def next_dist(seq: list[int]) -> list[float]:
        with torch.inference_mode():
            logits = target(torch.tensor(seq, device=target.device), target.new_cache(len(seq) + 1), logits_for=slice(-1, None))
        return logits_to_probs(logits[0].float(), params).double().tolist()

    joint: Exact = {(): 1.0}
    for _ in range(length):
        grown: Exact = {}
        for prefix, mass in joint.items():
            dist = next_dist(prompt + list(prefix)) if mass > 0 else [0.0] * vocab
            for tok in range(vocab):
                grown[prefix + (tok,)] = mass * dist[tok]
        joint = grown
    return joint


# ------------------------------------------------------------------ sampling with the decoder
@dataclass(frozen=True)
class DraftRecord:
    """What one ``propose`` call returned: the depth cap ``k`` and the drafted tree's size."""

    k: int
    nodes: int
    depth: int


class RecordingDrafter:
    """Forwards the drafter protocol to ``inner`` and records every draft's shape."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.drafts: list[DraftRecord] = []

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None:
        self.inner.begin(prompt, capacity, target_cache)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return self._record(k, self.inner.propose(k, params, generator))

    def propose_steps(self, k: int, params: SamplingParams, generator: torch.Generator) -> Any:
        """The steps the decoder runs (``Decoder.propose_steps``), recorded like ``propose``."""
        steps = getattr(self.inner, "propose_steps", None)
        draft = (yield from steps(k, params, generator)) if steps is not None else self.inner.propose(k, params, generator)
        return self._record(k, draft)

    def _record(self, k: int, draft: Draft) -> Draft:
        n = int(draft.tokens.numel())
        depth = compile_tree(tuple(draft.parents)).max_depth if draft.parents is not None else n
        self.drafts.append(DraftRecord(k, n, depth))
        return draft

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        self.inner.observe(n_accepted, new_tokens, path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Counted(Exception):
    """Raised before a round once the counted tokens exist: later rounds cannot change them."""

    def __init__(self, tokens: list[int], stats: DecodeStats) -> None:
        super().__init__()
        self.tokens, self.stats = tokens, stats


@dataclass
class Sample:
    counts: Counter[Cell]
    n: int
    stats: DecodeStats  # summed over seeds, for the rounds run until the counted tokens existed
    drafts: list[DraftRecord] = field(default_factory=list)


def sample_joint(
    decoder: Decoder, prompt: list[int], params: SamplingParams, depth: int,
    n_seeds: int = N_SEEDS, length: int = LENGTH,
) -> Sample:
    """Decode ``prompt`` with seeds ``0..n_seeds-1`` and count the first ``length`` tokens.

    ``depth``: the first speculative round drafts up to this depth (see :func:`first_round_config`).
    Decoding stops before the first round that would start after ``length`` tokens exist."""
    recorder = RecordingDrafter(decoder.drafter)
    decoder.drafter = recorder
    counts: Counter[Cell] = Counter()
    total = DecodeStats()

    def stop_when_counted(dec: Decoder, tokens: list[int], cache: KVCache, stats: DecodeStats) -> None:
        if len(tokens) >= len(prompt) + length:
            raise _Counted(tokens[len(prompt):], stats)

    try:
        for seed in range(n_seeds):
            try:
                res = decoder.generate(prompt, first_round_config(depth, params, seed), before_round=stop_when_counted)
                tokens, stats = res.tokens, res.stats
            except _Counted as done:
                tokens, stats = done.tokens, done.stats
            assert len(tokens) >= length, f"seed {seed}: decoded {tokens}, fewer than {length} tokens"
            counts[tuple(tokens[:length])] += 1
            total = total.merge(stats)
    finally:
        decoder.drafter = recorder.inner
    return Sample(counts, n_seeds, total, recorder.drafts)


# ------------------------------------------------------------------ the statistical test
@dataclass(frozen=True)
class ChiSquare:
    pvalue: float
    bins: int
    impossible: dict[Cell, int]  # sampled cells the target gives probability 0

    def __str__(self) -> str:
        return f"chi-square p={self.pvalue:.3g} over {self.bins} bins, impossible cells sampled: {self.impossible}"


def chi_square(exact: Exact, counts: Counter[Cell]) -> ChiSquare:
    """Goodness of fit of ``counts`` to ``exact``. Cells with expected count < ``MIN_EXPECTED``
    are pooled into one bin (grown with the next rarest cells until it reaches the minimum)."""
    impossible = {c: k for c, k in counts.items() if exact.get(c, 0.0) <= 0.0 and k > 0}
    n = sum(k for c, k in counts.items() if c not in impossible)
    mass = sum(exact.values())
    cells = sorted((c for c in exact if exact[c] > 0), key=lambda c: exact[c])
    expected = {c: exact[c] / mass * n for c in cells}
    rare = [c for c in cells if expected[c] < MIN_EXPECTED]
    bins = [[c] for c in cells if expected[c] >= MIN_EXPECTED]
    if rare:
        while sum(expected[c] for c in rare) < MIN_EXPECTED and bins:
            rare += bins.pop(0)
        bins.append(rare)
    obs = [sum(counts[c] for c in b) for b in bins]
    exp = [sum(expected[c] for c in b) for b in bins]
    return ChiSquare(float(chisquare(obs, exp).pvalue), len(bins), impossible)


def assert_matches_target(exact: Exact, sample: Sample) -> ChiSquare:
    result = chi_square(exact, sample.counts)
    assert not result.impossible, f"sampled tokens the target never produces: {result}"
    assert result.pvalue > ALPHA, f"the decoded distribution differs from the target's: {result}"
    return result


def check_speculated(
    sample: Sample, *, branched: bool = False, full_shape: TreeShape | None = None
) -> None:
    """The decodes really speculated: drafts were made, some rounds rejected the first draft
    (residual path), and some accepted a run of >= 2 drafts. ``branched``: some draft was a tree
    with more nodes than levels. ``full_shape``: some round that could draft ``full_shape`` to
    its full depth drafted fewer nodes (a confidence early stop)."""
    st = sample.stats
    summary = f"drafted={st.drafted} accepted={st.accepted} accept_hist={st.accept_hist}"
    assert st.drafted > 0, f"nothing was drafted: {summary}"
    assert st.accept_hist and st.accept_hist[0] > 0, f"no round rejected its first draft: {summary}"
    assert sum(st.accept_hist[2:]) > 0, f"no round accepted a run of >= 2 drafts: {summary}"
    if branched:
        assert any(d.nodes > d.depth for d in sample.drafts), "every draft was a chain"
    if full_shape is not None:
        depth, nodes = len(full_shape.widths), full_shape.max_nodes()
        full = [d for d in sample.drafts if d.k >= depth]
        assert full, "no round could draft the full shape"
        assert any(0 < d.nodes < nodes for d in full), f"the early stop never cut a {nodes}-node tree"
        assert any(d.depth >= 2 for d in full), "the early stop cut every tree at depth 1"
