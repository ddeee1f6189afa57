"""The per-request controller (issue 30) on tiny random-weight models: it switches between rounds
to the predicted-fastest strategy, stops speculation that measures slower than plain, and greedy
output stays token-identical to plain decoding through every switch."""
from __future__ import annotations

import pytest
import torch

from autotune.tuning.controller import ControlSettings, RequestController, RoutePriors, candidates, \
    generate_controlled, label
from autotune.tuning.corrections import Corrections
from autotune.tuning.cost_model import FixedCostModel
from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, TreeShape
from runtime.layout import CHAIN as CAUSAL
from runtime.lookup import PromptLookupDrafter
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.errors import SpaceError
from search_spaces.strategy import PLAIN, Strategy

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 12, 30]
WINDOW = 8
DIVERGE_AT = 24  # the scripted draft predicts the target's tokens before this many generated tokens
N_NEW = 72
CHAIN = Strategy(drafter="draft-model", draft_length=4, confidence_threshold=0.0)
# decisions from predictions alone: the tiny models' measured seconds are not the fixed cost model's
NEVER = 10**6
SETTINGS = ControlSettings(window=WINDOW, guard_tokens=NEVER, max_share=1.0, min_measured=NEVER)
# a round of plain decoding costs 1 s, a draft forward 0.05 s: drafting pays only while it matches
COST = FixedCostModel(draft_full_s=0.05, verify_const_s=1.0)


class Diverging(CausalLM):
    """A scripted draft model: the target's own weights (it predicts the target's tokens exactly)
    until the sequence reaches ``at`` tokens, then a confident wrong token (the target's argmax
    + 1) at every later position: drafts stop matching half-way through a request."""

    def __init__(self, hf_model: torch.nn.Module, at: int) -> None:
        super().__init__(hf_model)
        self.at = at

    def forward(self, tokens, cache, layout=CAUSAL, logits_for=None, plan=None):
        n = int(tokens.shape[0])
        pos = layout.positions if layout.positions is not None else cache.length + torch.arange(n)
        logits = super().forward(tokens, cache, layout, logits_for, plan)
        rows = torch.arange(n)[logits_for] if logits_for is not None else torch.arange(n)
        late = pos.reshape(-1)[rows] + 1 >= self.at  # the row predicts the token at position pos + 1
        if bool(late.any()):
            wrong = (logits.argmax(dim=-1) + 1) % logits.shape[-1]
            scripted = torch.full_like(logits, -30.0)
            scripted.scatter_(-1, wrong[:, None], 30.0)
            logits = torch.where(late[:, None].to(logits.device), scripted, logits)
        return logits

    __call__ = forward


class Counting(CausalLM):
    """A draft model that counts its scoring forwards (every row's logits over a whole window;
    drafting and catching up ask for the last row's)."""

    scorings = 0

    def forward(self, tokens, cache, layout=CAUSAL, logits_for=None, plan=None):
        if logits_for is None and int(tokens.shape[0]) >= WINDOW:
            self.scorings += 1
        return super().forward(tokens, cache, layout, logits_for, plan)

    __call__ = forward


@pytest.fixture(scope="module")
def hf_target() -> torch.nn.Module:
    return tiny_model("llama", 40, layers=3)


def plain(hf_target) -> list[int]:
    return Decoder(CausalLM(hf_target)).generate(PROMPT, GenerationConfig(max_new_tokens=N_NEW)).tokens


def decoder_with(hf_target, draft: CausalLM, lookup: bool) -> Decoder:
    target = CausalLM(hf_target)
    dec = Decoder(target, ModelDrafter(draft, target.dims.vocab, TreeShape((1,) * 4)), 4, verify_width=16,
                  kind="draft-model")
    if lookup:
        dec.standby["prompt-lookup"] = PromptLookupDrafter()
    return dec


def run(hf_target, controlled: bool, draft: CausalLM | None = None, lookup: bool = False,
        cost: FixedCostModel = COST, prior: Strategy = CHAIN, settings: ControlSettings = SETTINGS,
        corrections: Corrections | None = None, max_new_tokens: int | None = None):
    """Decode with ``prior`` (under the controller, or not) -> (tokens, controller or None,
    [(generated tokens, drafted so far)] after every round)."""
    draft = draft if draft is not None else Diverging(hf_target, len(PROMPT) + DIVERGE_AT)
    dec = decoder_with(hf_target, draft, lookup)
    seen: list[tuple[int, int]] = []
    cfg = GenerationConfig(max_new_tokens=N_NEW)
    if not controlled:
        dec.apply(prior)
        stats_box = {}

        def hook(d, tokens, cache, stats):
            stats_box["s"] = stats
            seen.append((len(tokens) - len(PROMPT), stats.drafted))

        result = dec.generate(PROMPT, cfg, before_round=hook)
        return result.tokens, None, seen
    ctl_box: dict[str, RequestController] = {}

    def make_hook(ctl):
        def hook(d, tokens, cache, stats):
            seen.append((len(tokens) - len(PROMPT), stats.drafted))
            ctl.before_round(d, tokens, cache, stats)
        return hook

    dec.apply(prior)
    ctl = RequestController(prior, dec, cost, len(PROMPT), settings, corrections or Corrections(),
                            max_new_tokens=max_new_tokens)
    ctl_box["c"] = ctl
    result = dec.generate(PROMPT, cfg, before_round=make_hook(ctl))
    return result.tokens, ctl, seen


def drafted_after(seen: list[tuple[int, int]], generated: int) -> int:
    """Tokens drafted by rounds that started once ``generated`` tokens existed."""
    before = max((d for g, d in seen if g <= generated), default=0)
    return seen[-1][1] - before if seen else 0


def switched_to_plain_within_two_windows(seen: list[tuple[int, int]]) -> bool:
    return drafted_after(seen, DIVERGE_AT + 2 * WINDOW) == 0


# ---------------------------------------------------------------------------------- the controller
def test_diverging_drafts_switch_to_plain_within_two_windows(hf_target):
    tokens, ctl, seen = run(hf_target, controlled=True)
    assert tokens == plain(hf_target)
    assert drafted_after([(0, 0)] + seen, 0) > 0  # it speculated while the drafts matched ...
    assert seen[[g for g, _ in seen].index(next(g for g, _ in seen if g >= DIVERGE_AT))][1] > 0
    assert ctl.current == PLAIN and ctl.switches >= 1  # ... and went plain once they did not
    assert switched_to_plain_within_two_windows(seen), ctl.decisions
    assert ctl.decisions[0].chose == label(CHAIN) and not ctl.decisions[0].switched  # kept while it matched


def test_no_scoring_where_the_request_ends_before_the_window_completes(hf_target):
    """A request that knows its end scores no window it cannot finish: here the controller of a
    request of ``N_NEW`` tokens told it ends after ``3 * WINDOW`` scores only at ``WINDOW`` and
    ``2 * WINDOW`` (the diverging draft is still kept then), where the same controller without an
    end scores at every window."""
    _, told, _ = run(hf_target, controlled=True, max_new_tokens=3 * WINDOW)
    _, untold, _ = run(hf_target, controlled=True)
    assert [d.at for d in told.decisions] == [d.at for d in untold.decisions if d.at + WINDOW <= 3 * WINDOW]
    assert len(untold.decisions) > len(told.decisions) >= 1


def test_without_the_controller_the_diverging_draft_keeps_drafting(hf_target):
    """The check above fails when nothing controls the request: the draft keeps drafting after
    it stopped matching (the test's power)."""
    tokens, _, seen = run(hf_target, controlled=False)
    assert tokens == plain(hf_target)
    assert not switched_to_plain_within_two_windows(seen)


def test_speculation_measured_slower_than_plain_stops_for_the_request(hf_target):
    """Predictions favour drafting (a free draft, a near-free verify) but plain decoding is priced
    at 1 us a token: every speculative round measures slower, so the guard stops it for good."""
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1e-6)
    draft = CausalLM(noisy_copy(hf_target, 0.02, 1))
    settings = ControlSettings(window=WINDOW, guard_tokens=WINDOW, max_share=1.0, min_measured=NEVER)
    tokens, ctl, seen = run(hf_target, controlled=True, draft=draft, cost=cost, settings=settings)
    assert tokens == plain(hf_target)
    assert ctl.stopped and ctl.current == PLAIN
    assert [d.reason for d in ctl.decisions if d.switched] == ["guard"]
    stop_at = next(d.at for d in ctl.decisions if d.reason == "guard")
    assert drafted_after(seen, stop_at) == 0 and drafted_after([(0, 0)] + seen, 0) > 0


@pytest.mark.parametrize("prior", [
    CHAIN,
    Strategy(drafter="draft-model", draft_length=4, tree_widths=(2, 2, 1, 1), confidence_threshold=0.0),
    Strategy(drafter="prompt-lookup", draft_length=6),
], ids=["chain", "tree", "lookup"])
def test_greedy_output_is_identical_through_switches(hf_target, prior):
    """A draft that matches, then does not, with lookup on standby: whatever the controller
    switches to, between rounds, the tokens are plain decoding's."""
    tokens, ctl, seen = run(hf_target, controlled=True, lookup=True, prior=prior)
    assert tokens == plain(hf_target)
    assert ctl.decisions and ctl.switches >= 1, ctl.decisions
    assert seen[-1][1] > 0  # something was drafted


def test_generate_controlled_leaves_the_decoder_on_its_prior(hf_target):
    dec = decoder_with(hf_target, Diverging(hf_target, len(PROMPT) + DIVERGE_AT), lookup=False)
    result, ctl = generate_controlled(dec, PROMPT, GenerationConfig(max_new_tokens=N_NEW), CHAIN, COST, SETTINGS)
    assert result.tokens == plain(hf_target) and ctl.switches >= 1
    assert dec.kind == "draft-model" and dec.draft_length == CHAIN.draft_length
    summary = ctl.summary(decode_s=result.stats.wall_s)
    assert summary["prior"] == "draft-model-4" and summary["final"] == "plain" and summary["switches"] == ctl.switches
    assert 0 <= summary["scoring_share"]


def test_scoring_a_drafting_model_stays_within_its_share(hf_target):
    """With a 2% share the drafting model is scored at the first window, then only once decode
    time has paid for it: fewer scoring forwards than with no limit, where every window scores."""

    def scorings(share: float) -> tuple[int, int]:
        draft = Counting(noisy_copy(hf_target, 0.02, 1))
        settings = ControlSettings(window=WINDOW, guard_tokens=NEVER, max_share=share, min_measured=NEVER)
        cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1e-6)
        tokens, ctl, _ = run(hf_target, controlled=True, draft=draft, cost=cost, settings=settings)
        assert tokens == plain(hf_target) and ctl.current == CHAIN
        return draft.scorings, len(ctl.decisions)

    unlimited, windows = scorings(1.0)
    assert unlimited == windows >= 6
    limited, _ = scorings(0.02)
    assert 1 <= limited < unlimited


def test_a_batchs_controllers_share_one_budget():
    """Requests decoded side by side share the decode thread: each one's scoring allowance accrues
    at its share of ``max_share`` (four in a batch: a quarter each), so together they keep to it."""
    from autotune.tuning.budget import Budget

    alone, shared = Budget(0.02, lambda: 0.0), Budget(0.02, lambda: 0.0)
    for b in (alone, shared):
        b.accrue(0.0)
    alone.accrue(10.0)
    shared.accrue(10.0, sharers=4)
    assert alone.allowance == pytest.approx(0.2) and shared.allowance == pytest.approx(0.05)


def test_a_later_requests_first_score_waits_for_its_budget(hf_target):
    """What scoring the draft model cost is shared: the first request scores it at once (nothing
    is known), the next one only once its own decode time has paid for it."""
    shared = Corrections()
    settings = ControlSettings(window=WINDOW, guard_tokens=NEVER, max_share=0.02, min_measured=NEVER)
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1e-6)
    counts = []
    for _ in range(2):
        draft = Counting(noisy_copy(hf_target, 0.02, 1))
        tokens, ctl, _ = run(hf_target, controlled=True, draft=draft, cost=cost, settings=settings,
                             corrections=shared)
        assert tokens == plain(hf_target)
        counts.append((draft.scorings, ctl.decisions[0].scores))
    assert counts[0][0] >= 1 and shared.model_s is not None
    assert counts[0][0] >= counts[1][0]
    assert "draft-model-4" in counts[0][1] and "draft-model-4" not in counts[1][1]  # not scored at its first window



def test_a_requests_measured_stretches_correct_the_next_requests_prices(hf_target):
    """What the strategy decoding measured between decisions goes to the corrections the server's
    requests share (``autotune.tuning.corrections``, the tuner's scheme), keyed by strategy: the
    next request prices a candidate at its prediction times that factor."""
    settings = ControlSettings(window=WINDOW, guard_tokens=NEVER, max_share=1.0, min_measured=1)
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1e-6)  # drafting priced free (and far too fast)

    def first_scores(corrections: Corrections) -> tuple[dict[str, float], RequestController]:
        tokens, ctl, _ = run(hf_target, controlled=True, draft=CausalLM(noisy_copy(hf_target, 0.02, 1)), cost=cost,
                             settings=settings, corrections=corrections)
        assert tokens == plain(hf_target)
        return ctl.decisions[0].scores, ctl

    unaided, _ = first_scores(Corrections())
    shared = Corrections()
    _, ctl = first_scores(shared)
    assert shared.evidence and all(s.drafter == CHAIN.drafter for s in shared.evidence)
    # the shorter chain is not the prior: the next request's first decision prices it, not measures it
    half = next(s for s in ctl.options if s.drafter == CHAIN.drafter and s.draft_length < CHAIN.draft_length)
    factor = shared.factor(half)
    assert factor < 1.0  # priced far too fast: measured speed is a fraction of the prediction
    corrected, _ = first_scores(shared)
    assert corrected[label(half)] == pytest.approx(unaided[label(half)] * factor, rel=0.01)


# ---------------------------------------------------------------------------------- candidates
def test_candidates_are_the_prior_plain_lookup_and_cheap_neighbours():
    tree = Strategy(drafter="draft-model", draft_length=6, tree_widths=(2, 2, 1, 1, 1, 1))
    got = candidates(tree, width=24, kinds=["draft-model", "prompt-lookup"], lookup_length=8)
    chain = Strategy(drafter="draft-model", draft_length=6)
    assert got == [tree, PLAIN, Strategy(drafter="prompt-lookup", draft_length=8), chain,
                   Strategy(drafter="draft-model", draft_length=3)]
    # no lookup drafter on the decoder, a narrow verify: lookup is cut, the tree does not fit
    assert candidates(chain, width=7, kinds=["draft-model"], lookup_length=8) == [
        chain, PLAIN, Strategy(drafter="draft-model", draft_length=3)]
    assert candidates(PLAIN, width=5, kinds=["prompt-lookup"], lookup_length=8) == [
        PLAIN, Strategy(drafter="prompt-lookup", draft_length=4)]
    assert [label(s) for s in got] == ["draft-model-tree-6", "plain", "lookup-8", "draft-model-6", "draft-model-3"]


@pytest.mark.parametrize("bad", [dict(window=0), dict(margin=1.0), dict(max_share=0.0), dict(guard_tokens=True)])
def test_settings_are_validated(bad):
    with pytest.raises(SpaceError, match="request control setting"):
        ControlSettings(**bad)


# ---------------------------------------------------------------------------------- route priors
def test_a_route_starts_where_most_of_its_latest_requests_ended():
    look = Strategy(drafter="prompt-lookup", draft_length=8)
    options = candidates(CHAIN, width=16, kinds=["draft-model", "prompt-lookup"], lookup_length=8)
    priors = RoutePriors(keep=4, quorum=3)
    assert priors.start("gsm8k", CHAIN, options) == CHAIN  # nothing seen yet
    for final in (PLAIN, CHAIN, PLAIN):
        priors.observe("gsm8k", final)
    assert priors.start("gsm8k", CHAIN, options) == CHAIN  # 2 of 3: no quorum
    priors.observe("gsm8k", PLAIN)
    assert priors.start("gsm8k", CHAIN, options) == PLAIN  # 3 of the latest 4
    assert priors.start("humaneval", CHAIN, options) == CHAIN  # routes are apart
    for _ in range(3):
        priors.observe("gsm8k", look)
    assert priors.start("gsm8k", CHAIN, options) == look  # it follows the latest requests
    assert priors.start("gsm8k", CHAIN, [CHAIN, PLAIN]) == CHAIN  # only where the request can decode it
    assert priors.describe()["gsm8k"] == ["plain", "lookup-8", "lookup-8", "lookup-8"]


def test_a_moved_prior_applies_only_as_far_from_the_route_as_its_voters():
    look = Strategy(drafter="prompt-lookup", draft_length=8)
    options = candidates(PLAIN, width=16, kinds=["draft-model", "prompt-lookup"], lookup_length=8)
    priors = RoutePriors(keep=4, quorum=3)
    for d in (0.30, 0.42, 0.35):
        priors.observe("humaneval", look, distance=d)
    assert priors.start("humaneval", PLAIN, options, distance=0.40) == look  # as close as its voters
    assert priors.start("humaneval", PLAIN, options, distance=0.42) == look
    assert priors.start("humaneval", PLAIN, options, distance=0.61) == PLAIN  # routed near the threshold
    assert priors.start("humaneval", PLAIN, options) == look  # no distance (an explicit route): the moved prior
    priors.observe("humaneval", look, distance=0.62)  # a far request that ended there widens the reach
    assert priors.start("humaneval", PLAIN, options, distance=0.61) == look
    unknown = RoutePriors(keep=4, quorum=3)
    for _ in range(3):
        unknown.observe("gsm8k", look)  # voters without a distance: no reach to compare with
    assert unknown.start("gsm8k", PLAIN, options, distance=0.9) == look


def test_route_priors_are_bounded():
    priors = RoutePriors(max_routes=3)
    for i in range(10):
        priors.observe(f"r{i}", PLAIN)
    assert list(priors.describe()) == ["r7", "r8", "r9"]


def test_a_controller_starts_at_its_start_and_still_scores_the_prior(hf_target):
    dec = decoder_with(hf_target, CausalLM(noisy_copy(hf_target, 0.02, 1)), lookup=True)
    dec.apply(CHAIN)
    ctl = RequestController(CHAIN, dec, COST, len(PROMPT), SETTINGS, start=PLAIN)
    assert ctl.current == PLAIN and dec.kind is None and CHAIN in ctl.options
    result = dec.generate(PROMPT, GenerationConfig(max_new_tokens=N_NEW), before_round=ctl.before_round)
    assert result.tokens == plain(hf_target)
    assert ctl.summary()["start"] == "plain" and ctl.summary()["prior"] == "draft-model-4"
    assert ctl.current != PLAIN and result.stats.drafted > 0  # the noisy copy matches: back to drafting




def test_a_plain_prior_on_a_lookup_decoder_can_reach_lookup(hf_target):
    """A route stored as plain decoding, on a decoder with prompt lookup on standby: lookup is a
    candidate. (A server's default draft chain is not: measured, it lost more than it won.)"""
    from autotune.tuning.controller import decoder_options

    target = CausalLM(hf_target)
    looked = Decoder(target, PromptLookupDrafter(), 8, verify_width=16, kind="prompt-lookup")
    looked.apply(PLAIN)
    assert decoder_options(PLAIN, looked, SETTINGS) == [PLAIN, Strategy(drafter="prompt-lookup", draft_length=8)]


def test_the_last_stretch_of_a_request_teaches_the_corrections(hf_target):
    """No round follows a request's last one: ``finish`` hands what its strategy decoded since the
    last decision to the corrections (a request that switched to a strategy that then lost teaches
    the next one even when it ended before another decision)."""
    settings = ControlSettings(window=WINDOW, guard_tokens=NEVER, max_share=1.0, min_measured=1)
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1.0)  # a 1 s plain step: the measured chain is kept
    dec = decoder_with(hf_target, CausalLM(noisy_copy(hf_target, 0.02, 1)), lookup=False)
    dec.apply(CHAIN)
    corrections = Corrections()
    ctl = RequestController(CHAIN, dec, cost, len(PROMPT), settings, corrections)
    result = dec.generate(PROMPT, GenerationConfig(max_new_tokens=N_NEW), before_round=ctl.before_round)
    assert ctl.current.speculates and result.stats.drafted > 0

    def measured_tokens() -> float:
        return sum(ev.tokens for ev in corrections.evidence.values())

    before = measured_tokens()
    ctl.finish(PROMPT + result.tokens, result.stats)
    assert measured_tokens() > before
    after = measured_tokens()
    ctl.finish(PROMPT + result.tokens, result.stats)  # nothing new decoded: nothing counted twice
    assert measured_tokens() == after
