"""Tests for runtime.sampling: adjusted distributions, and exactness of speculative sampling.

Distribution checks run the real verify_chain many times with fixed seeds and compare the
empirical output distribution to p with a chi-square test; a deliberately broken residual shows
the test has power.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from runtime import sampling
from runtime.sampling import (
    SamplingParams,
    logits_to_probs,
    residual,
    reuse_or_draw,
    sample,
    verify_chain,
    verify_chain_greedy,
)

N_DRAWS = 10_000  # per single-step case
N_JOINT = 20_000  # two-token chain: 16 categories
P_MIN = 1e-3  # a correct sampler must pass (fixed seeds make this deterministic)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


def _dirichlet(v: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet(np.ones(v)), dtype=torch.float32)


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probs; zero-probability categories must be empty."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    support = probs > 0
    assert counts[~support].sum() == 0, f"zero-probability outcomes drawn: {counts[~support]}"
    if support.sum() == 1:
        return 1.0  # one possible outcome: the exact check above is the whole test
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def _single_step_counts(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
                        seed: int) -> np.ndarray:
    """Output-token counts of one speculative step (k=1) per draft token in drafts: [N]."""
    gen = _gen(seed)
    v = p.shape[0]
    p_chain = torch.stack([p, torch.full((v,), 1.0 / v)])  # [2, V]; bonus row is irrelevant here
    q_chain = None if q is None else q[None, :]  # [1, V]
    counts = np.zeros(v, dtype=np.int64)
    for x in drafts.tolist():
        n, tok = verify_chain(p_chain, q_chain, torch.tensor([x]), gen)
        counts[x if n == 1 else tok] += 1
    return counts


# --- SamplingParams ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_params_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert "allowed" in str(info.value)


def test_params_greedy_flag() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


# --- logits_to_probs ---------------------------------------------------------------------------

_distinct_logits = st.lists(st.integers(-1000, 1000), min_size=2, max_size=12, unique=True).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32) / 100.0
)


@settings(max_examples=150, deadline=None)
@given(
    logits=_distinct_logits,
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 14),
    top_p=st.floats(0.01, 1.0),
)
def test_probs_rows_sum_to_one(logits: torch.Tensor, temperature: float, top_k: int,
                               top_p: float) -> None:
    batch = torch.stack([logits, logits.flip(0), -logits])  # [3, V]
    probs = logits_to_probs(batch, SamplingParams(temperature, top_k, top_p))
    assert probs.dtype == torch.float32 and probs.shape == batch.shape
    assert torch.all(probs >= 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3), atol=1e-5, rtol=0)


@settings(max_examples=150, deadline=None)
@given(logits=_distinct_logits, temperature=st.floats(0.5, 2.0), data=st.data())
def test_top_k_keeps_exactly_k(logits: torch.Tensor, temperature: float,
                               data: st.DataObject) -> None:
    k = data.draw(st.integers(1, logits.numel()))
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=k))
    kept = torch.nonzero(probs > 0).flatten()
    assert kept.numel() == k
    assert set(kept.tolist()) == set(torch.topk(logits, k).indices.tolist())


@settings(max_examples=200, deadline=None)
@given(logits=_distinct_logits, temperature=st.floats(0.3, 3.0), top_p=st.floats(0.01, 0.999))
def test_top_p_keeps_minimal_nucleus(logits: torch.Tensor, temperature: float,
                                     top_p: float) -> None:
    full = torch.softmax(logits.double() / temperature, -1)  # [V] reference, float64
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
    kept = probs > 0
    m = int(kept.sum())
    order = torch.argsort(full, descending=True)
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:m].tolist())  # top-m tokens
    mass = full[order].cumsum(0)
    assert mass[m - 1] >= top_p - 1e-5  # enough mass ...
    assert m == 1 or mass[m - 2] < top_p + 1e-5  # ... and minimal
    torch.testing.assert_close(probs[kept].double(), full[kept] / full[kept].sum(),
                               atol=1e-5, rtol=1e-4)


def test_top_k_then_top_p_and_one_token_floor() -> None:
    logits = torch.log(_dist(50, 30, 15, 5))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    # top-3 renormalised: .526, .316, .158 -> nucleus >= .8 is the first two
    torch.testing.assert_close(probs, _dist(50, 30, 0, 0))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    torch.testing.assert_close(probs, _dist(1, 0, 0, 0))


@settings(max_examples=100, deadline=None)
@given(logits=_distinct_logits, top_k=st.integers(0, 5), top_p=st.floats(0.01, 1.0))
def test_greedy_is_one_hot_argmax(logits: torch.Tensor, top_k: int, top_p: float) -> None:
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=top_k, top_p=top_p))
    expected = torch.zeros_like(logits)
    expected[int(torch.argmax(logits))] = 1.0
    assert torch.equal(probs, expected)


def test_greedy_ties_lowest_index() -> None:
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]), SamplingParams())
    assert probs.argmax(-1).tolist() == [1, 0]
    assert probs.sum().item() == 2.0


# --- sample / residual -------------------------------------------------------------------------

def test_sample_shapes_and_generator_reproducibility() -> None:
    p = _dist(1, 2, 3, 4)
    assert sample(p, _gen(0)).shape == ()
    batch = sample(p.expand(500, 4), _gen(1))
    assert batch.shape == (500,) and batch.dtype == torch.long
    assert torch.equal(batch, sample(p.expand(500, 4), _gen(1)))
    with pytest.raises(ValueError, match="shape"):
        sample(p.reshape(1, 1, 4), _gen(0))


def test_residual_values_and_zero_mass() -> None:
    p, q = _dist(5, 3, 2, 0), _dist(2, 4, 2, 2)
    torch.testing.assert_close(residual(p, q), _dist(3, 0, 0, 0))
    torch.testing.assert_close(residual(p, p), p)  # zero residual mass -> p
    batched = residual(torch.stack([p, p]), torch.stack([q, p]))
    torch.testing.assert_close(batched, torch.stack([_dist(3, 0, 0, 0), p]))


# --- verify_chain: single step chi-square ------------------------------------------------------

_V = 6
_SINGLE_STEP_CASES = {
    "random": (_dirichlet(_V, 1), _dirichlet(_V, 2)),
    "q_zero_where_p_positive": (_dirichlet(_V, 3), _dist(3, 2, 0, 0, 1, 0)),
    "p_with_zeros": (_dist(4, 0, 3, 0, 2, 1), _dirichlet(_V, 4)),
    "p_equals_q": (_dirichlet(_V, 5), _dirichlet(_V, 5)),
    "disjoint_support": (_dist(0, 0, 0, 1, 2, 3), _dist(5, 3, 2, 0, 0, 0)),
    "greedy_target": (_dist(0, 0, 1, 0, 0, 0), _dirichlet(_V, 6)),
    "binary": (_dist(1, 1), _dist(9, 1)),
}


@pytest.mark.parametrize("case", sorted(_SINGLE_STEP_CASES))
def test_single_step_output_matches_p(case: str) -> None:
    p, q = _SINGLE_STEP_CASES[case]
    drafts = sample(q.expand(N_DRAWS, -1), _gen(10))  # [N], x ~ q
    counts = _single_step_counts(p, q, drafts, seed=11)
    assert _chisquare_pvalue(counts, p.numpy()) > P_MIN


@pytest.mark.parametrize("draft", [0, 1, 2])
def test_deterministic_draft_output_matches_p(draft: int) -> None:
    p = _dist(5, 0, 3, 2)  # draft 0: p>0, draft 1: p=0 (always rejected), draft 2: p>0
    drafts = torch.full((N_DRAWS,), draft)
    counts = _single_step_counts(p, None, drafts, seed=20 + draft)
    assert _chisquare_pvalue(counts, p.numpy()) > P_MIN


def test_deterministic_draft_with_certain_target_always_accepted() -> None:
    p = torch.stack([_dist(0, 1, 0), _dist(1, 1, 1)])
    gen = _gen(3)
    assert all(verify_chain(p, None, torch.tensor([1]), gen)[0] == 1 for _ in range(50))


def _decode_two(p0: torch.Tensor, p1: torch.Tensor, q0: torch.Tensor, q1: torch.Tensor,
                gen: torch.Generator) -> tuple[int, int]:
    """First two output tokens of a decode loop: a k=2 chain, then a k=1 step if needed.

    p1[a], q1[a] are the position-1 distributions given first token a.
    """
    v = p0.shape[0]
    x0 = int(sample(q0, gen))
    x1 = int(sample(q1[x0], gen))
    bonus = torch.full((v,), 1.0 / v)
    n, tok = verify_chain(torch.stack([p0, p1[x0], bonus]), torch.stack([q0, q1[x0]]),
                          torch.tensor([x0, x1]), gen)
    if n == 2:
        return x0, x1
    if n == 1:
        return x0, tok
    y = int(sample(q1[tok], gen))  # next step: draft again, conditioned on the resampled token
    m, tok2 = verify_chain(torch.stack([p1[tok], bonus]), q1[tok][None], torch.tensor([y]), gen)
    return tok, (y if m == 1 else tok2)


def test_two_token_chain_joint_matches_p() -> None:
    v = 4
    p0, q0 = _dist(4, 3, 2, 1), _dist(1, 1, 3, 0)
    p1 = torch.stack([_dirichlet(v, 30 + a) for a in range(v)])  # [V, V], p1[a] = p(. | x0=a)
    p1[1] = _dist(0, 2, 0, 1)  # zeros in p
    q1 = torch.stack([_dirichlet(v, 40 + a) for a in range(v)])
    q1[2] = _dist(1, 0, 0, 1)  # zeros in q where p > 0
    gen = _gen(50)
    counts = np.zeros((v, v), dtype=np.int64)
    for _ in range(N_JOINT):
        a, b = _decode_two(p0, p1, q0, q1, gen)
        counts[a, b] += 1
    joint = (p0[:, None] * p1).numpy()  # [V, V], p0(a) * p1(b | a)
    assert _chisquare_pvalue(counts, joint) > P_MIN


def test_chi_square_has_power_against_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    p, q = _SINGLE_STEP_CASES["binary"]  # correct output ~ (.5, .5); resampling from p gives (.7, .3)
    drafts = sample(q.expand(N_DRAWS, -1), _gen(10))
    monkeypatch.setattr(sampling, "residual", lambda p_, q_: p_)
    counts = _single_step_counts(p, q, drafts, seed=11)
    assert _chisquare_pvalue(counts, p.numpy()) < 1e-6


# --- reuse_or_draw: a lookup copy checked against the draft's q --------------------------------

def _reuse_counts(q: torch.Tensor, proposed: int, seed: int, rule=reuse_or_draw) -> tuple[np.ndarray, int]:
    gen = _gen(seed)
    counts = np.zeros(q.shape[0], dtype=np.int64)
    kept = 0
    for _ in range(N_DRAWS):
        tok, was_kept = rule(q, proposed, gen)
        counts[tok] += 1
        kept += was_kept
        assert not was_kept or tok == proposed
    return counts, kept


@pytest.mark.parametrize("proposed", [0, 2, 3])
def test_reuse_or_draw_is_distributed_as_q(proposed: int) -> None:
    """The copied token is kept with probability q(copy), else drawn from q without it: the
    token is a draw from q whichever way (token 3 has q = 0: never kept)."""
    q = _dist(5, 1, 3, 0, 1)
    counts, kept = _reuse_counts(q, proposed, seed=60 + proposed)
    assert _chisquare_pvalue(counts, q.numpy()) > P_MIN
    assert abs(kept / N_DRAWS - float(q[proposed])) < 0.02
    assert counts[3] == 0


def test_reuse_or_draw_greedy_keeps_exactly_the_argmax() -> None:
    q = _dist(0, 0, 1, 0)  # greedy: one-hot
    gen = _gen(1)
    state = gen.get_state()
    assert reuse_or_draw(q, 2, gen) == (2, True)
    assert reuse_or_draw(q, 1, gen) == (2, False)
    assert torch.equal(gen.get_state(), state)  # no random draw


def test_reuse_or_draw_check_has_power_against_a_wrong_redraw() -> None:
    """The same check rejects a rule that, after not keeping the copy, draws from q itself (so
    the copy comes back too often)."""
    def redraw_from_q(q: torch.Tensor, proposed: int, gen: torch.Generator) -> tuple[int, bool]:
        if float(torch.rand((), generator=gen)) < float(q[proposed]):
            return proposed, True
        return int(sample(q, gen)), False

    q = _dist(5, 1, 3, 0, 1)
    counts, _ = _reuse_counts(q, 0, seed=60, rule=redraw_from_q)
    assert _chisquare_pvalue(counts, q.numpy()) < 1e-6


# --- verify_chain: properties and errors --------------------------------------------------------

_prob_rows = st.lists(st.integers(0, 5), min_size=4, max_size=4).filter(any).map(
    lambda w: torch.tensor(w, dtype=torch.float32) / sum(w)
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), k=st.integers(0, 4), seed=st.integers(0, 2**31 - 1))
def test_verify_chain_invariants(data: st.DataObject, k: int, seed: int) -> None:
    p = torch.stack([data.draw(_prob_rows) for _ in range(k + 1)])  # [k+1, 4]
    q = torch.stack([data.draw(_prob_rows) for _ in range(k)]) if k else torch.zeros(0, 4)
    gen = _gen(seed)
    drafts = sample(q, gen) if k else torch.zeros(0, dtype=torch.long)  # [k]
    n, tok = verify_chain(p, q, drafts, gen)
    assert 0 <= n <= k
    assert p[n, tok] > 0  # never emits a token the target rules out
    if n < k:  # resampled token comes from the residual (or p itself when p == q)
        assert p[n, tok] > q[n, tok] or torch.allclose(p[n], q[n])
    # a token with p == 0 is never accepted
    assert all(p[i, drafts[i]] > 0 for i in range(n))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), k=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_one_hot_target_agrees_with_greedy_helper(data: st.DataObject, k: int, seed: int) -> None:
    target = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1)))
    drafts = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)),
                          dtype=torch.long)
    p = torch.nn.functional.one_hot(target, 4).float()  # [k+1, 4]
    q = torch.full((k, 4), 0.25)
    expected = verify_chain_greedy(target, drafts)
    assert verify_chain(p, q, drafts, _gen(seed)) == expected
    assert verify_chain(p, None, drafts, _gen(seed)) == expected


def test_verify_chain_rejects_token_with_zero_draft_prob() -> None:
    p = torch.stack([_dist(1, 1, 1), _dist(1, 1, 1)])
    with pytest.raises(ValueError, match=r"q\[0, 2\] = 0.*q=None"):
        verify_chain(p, _dist(1, 1, 0)[None], torch.tensor([2]), _gen(0))


def test_verify_chain_shape_errors() -> None:
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="p must have shape"):
        verify_chain(p, torch.full((1, 4), 0.25), torch.tensor([0]), _gen(0))
    with pytest.raises(ValueError, match="q must have shape"):
        verify_chain(p, torch.full((2, 3), 0.25), torch.tensor([0, 1]), _gen(0))


def test_verify_chain_all_accepted_draws_bonus_from_last_row() -> None:
    p = torch.stack([_dist(1, 0, 0), _dist(0, 1, 0), _dist(0, 0, 1)])
    assert verify_chain(p, p[:2], torch.tensor([0, 1]), _gen(0)) == (2, 2)


# --- verify_chain_greedy -----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("target", "drafts", "expected"),
    [
        ([5, 6, 7, 8], [5, 6, 7], (3, 8)),  # all accepted: bonus token
        ([5, 6, 7, 8], [1, 6, 7], (0, 5)),  # none accepted
        ([5, 6, 7, 8], [5, 1, 7], (1, 6)),  # later match after a miss does not count
        ([5, 6, 7, 8], [5, 6, 1], (2, 7)),
        ([9], [], (0, 9)),  # k = 0
    ],
)
def test_verify_chain_greedy_cases(target: list[int], drafts: list[int],
                                   expected: tuple[int, int]) -> None:
    result = verify_chain_greedy(torch.tensor(target), torch.tensor(drafts, dtype=torch.long))
    assert result == expected
    assert all(isinstance(x, int) for x in result)


def test_verify_chain_greedy_shape_error() -> None:
    with pytest.raises(ValueError, match="target_argmax"):
        verify_chain_greedy(torch.tensor([1, 2]), torch.tensor([1, 2]))


def test_no_global_rng_use_and_inputs_untouched() -> None:
    """Draws come only from the explicit generators, and the pure functions never write to their
    inputs (``p`` and ``q`` are reused by tree verification after a chain is checked)."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    p = torch.stack([_dist(1, 2, 3), _dist(3, 2, 1)])
    q = _dist(3, 2, 1)[None]
    p_in, q_in = p.clone(), q.clone()
    for seed in range(20):  # rejections and acceptances both happen (q over-weights token 0)
        verify_chain(p, q, torch.tensor([0]), _gen(seed))
        sample(p, _gen(seed))
    assert torch.equal(before, torch.get_rng_state())
    assert torch.equal(p, p_in) and torch.equal(q, q_in)
