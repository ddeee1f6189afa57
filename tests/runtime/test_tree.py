"""Tests for runtime.tree (draft token trees, tree attention masks) and runtime.tree_verify
(greedy tree verification and SpecInfer multi-step speculative sampling, "MSS", Theorem 4.2).

The key test runs a small simulated decode loop over random draft trees and checks with a
chi-square test that the joint distribution of the first TWO output tokens equals the target's
p(a) * p(b | a). When the first verify round accepts nothing (it emits a single token), the loop
runs a SECOND verify round with a fresh tree drafted at the new one-token history, exactly as the
decoder's next iteration would. A deliberately broken residual shows the test has power.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from runtime import tree_verify
from runtime.tree import CompiledTree, compile_tree, verify_mask
from runtime.tree_verify import verify_tree, verify_tree_greedy

P_MIN = 1e-3  # a correct sampler must pass (fixed seeds make this deterministic)
N_TRIALS = 6_000  # decode simulations per chi-square configuration (V=6 -> 36 cells)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ancestors(parents: tuple[int, ...], node: int) -> list[int]:
    out = []
    node = parents[node]
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out


_parents = st.integers(0, 12).flatmap(
    lambda n: st.tuples(*[st.integers(-1, i - 1) for i in range(n)])
)


# --- compile_tree / verify_mask ----------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(parents=_parents)
def test_tree_mask_depth_children_paths(parents: tuple[int, ...]) -> None:
    tree = compile_tree(parents)
    n = len(parents)
    assert isinstance(tree, CompiledTree) and tree.size == n
    assert tree.mask.shape == (n + 1, n + 1) and tree.mask.dtype == torch.bool
    # root row sees only itself
    assert tree.mask[0].tolist() == [True] + [False] * n
    for i in range(n):
        anc = _ancestors(parents, i)
        expected = {0, i + 1} | {a + 1 for a in anc}
        assert set(torch.nonzero(tree.mask[i + 1]).flatten().tolist()) == expected
        assert int(tree.depth[i]) == len(anc) + 1
        assert tree.path_to(i) == anc[::-1] + [i]
    assert tree.depth.dtype == torch.long and tree.depth.shape == (n,)
    assert tree.max_depth == (max(len(_ancestors(parents, i)) + 1 for i in range(n)) if n else 0)
    assert len(tree.children) == n + 1
    for row in range(n + 1):
        assert tree.children[row] == tuple(i for i in range(n) if parents[i] == row - 1)
    assert tree.is_chain == (parents == tuple(range(-1, n - 1)))


@settings(max_examples=100, deadline=None)
@given(parents=_parents, prefix=st.sampled_from([0, 5]), pad=st.sampled_from([0, 2]))
def test_verify_mask(parents: tuple[int, ...], prefix: int, pad: int) -> None:
    tree = compile_tree(parents)
    n = len(parents) + 1  # root + nodes
    mask = verify_mask(tree, prefix=prefix, pad=pad)
    assert mask.shape == (n + pad, prefix + n + pad) and mask.dtype == torch.bool
    for r in range(n + pad):
        seen = set(torch.nonzero(mask[r]).flatten().tolist())
        if r < n:  # root / node: whole prefix + root + ancestors + itself
            tree_cols = {0, r} | ({a + 1 for a in _ancestors(parents, r - 1)} if r else set())
        else:  # padding: prefix + itself only
            tree_cols = {r}
        assert seen == set(range(prefix)) | {prefix + c for c in tree_cols}, (r, seen)


def test_verify_mask_default_pad_and_concrete_case() -> None:
    tree = compile_tree((-1, -1, 0))
    assert torch.equal(verify_mask(tree, prefix=0), tree.mask)
    expected = torch.tensor([
        # p0 p1 root n0 n1 n2 pad
        [1, 1, 1, 0, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0, 0],  # n0
        [1, 1, 1, 0, 1, 0, 0],  # n1
        [1, 1, 1, 1, 0, 1, 0],  # n2 (child of n0)
        [1, 1, 0, 0, 0, 0, 1],  # padding
    ], dtype=torch.bool)
    assert torch.equal(verify_mask(tree, prefix=2, pad=1), expected)


def test_chain_and_empty_tree() -> None:
    assert compile_tree((-1, 0, 1, 2)).is_chain
    assert not compile_tree((-1, 0, 0)).is_chain
    assert not compile_tree((-1, -1)).is_chain
    empty = compile_tree(())
    assert empty.is_chain and empty.size == 0 and empty.max_depth == 0
    assert empty.mask.shape == (1, 1) and bool(empty.mask[0, 0])
    assert empty.children == ((),)


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, 5), (-2,), (-1, -3), (-1, 0, 2)])
def test_invalid_parents_raise(parents: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="parent"):
        compile_tree(parents)


# --- verify_tree_greedy ------------------------------------------------------------------------

# root -> n0(5) -> n2(8);  root -> n1(7) -> n3(9) -> n4(4)
_HAND = compile_tree((-1, -1, 0, 1, 3))
_HAND_TOKENS = torch.tensor([5, 7, 8, 9, 4])


@pytest.mark.parametrize(
    ("argmax", "expected"),
    [
        ([7, 0, 9, 0, 4, 2], ([1, 3, 4], 2)),  # longer branch all the way: bonus at the leaf
        ([7, 0, 9, 0, 3, 2], ([1, 3], 3)),  # stops inside the longer branch
        ([5, 8, 0, 1, 0, 0], ([0, 2], 1)),  # the other branch, to its leaf: bonus token
        ([5, 9, 0, 0, 0, 0], ([0], 9)),  # first branch, mismatch below
        ([6, 5, 9, 0, 4, 2], ([], 6)),  # no root child matches -> argmax[0]
    ],
)
def test_greedy_hand_cases(argmax: list[int], expected: tuple[list[int], int]) -> None:
    result = verify_tree_greedy(torch.tensor(argmax), _HAND, _HAND_TOKENS)
    assert result == expected
    assert isinstance(result[1], int)


def test_greedy_empty_tree() -> None:
    no_tokens = torch.zeros(0, dtype=torch.long)
    assert verify_tree_greedy(torch.tensor([3]), compile_tree(()), no_tokens) == ([], 3)


def test_verify_tree_empty_tree_samples_from_root() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0]])
    no_tokens = torch.zeros(0, dtype=torch.long)
    for q in (None, torch.zeros(0, 3)):
        assert verify_tree(p, compile_tree(()), no_tokens, q, _gen(0)) == ([], 2)


def _greedy_path_valid(argmax: list[int], tree: CompiledTree, tokens: list[int],
                       path: list[int], nxt: int) -> None:
    row = 0
    for node in path:
        assert node in tree.children[row] and tokens[node] == argmax[row]
        row = node + 1
    assert nxt == argmax[row]
    assert all(tokens[c] != argmax[row] for c in tree.children[row])  # maximal


def test_greedy_duplicate_sibling_tokens() -> None:
    # two root children with the same token 5 (same history -> same target rows)
    argmax = [5, 6, 6, 9]
    # the first duplicate has the continuation
    tree = compile_tree((-1, -1, 0))
    path, nxt = verify_tree_greedy(torch.tensor(argmax), tree, torch.tensor([5, 5, 6]))
    assert (path, nxt) == ([0, 2], 9)
    # the second duplicate has the continuation: any valid, maximal matching path is lossless
    # (the emitted tokens are argmax tokens either way); see report re. longest-path choice
    tree = compile_tree((-1, -1, 1))
    path, nxt = verify_tree_greedy(torch.tensor(argmax), tree, torch.tensor([5, 5, 6]))
    _greedy_path_valid(argmax, tree, [5, 5, 6], path, nxt)
    assert [5, 6, 9][: len(path) + 1] == [[5, 5, 6][i] for i in path] + [nxt]


@settings(max_examples=150, deadline=None)
@given(parents=_parents, data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_one_hot_target_tree_verify_agrees_with_greedy(parents: tuple[int, ...],
                                                       data: st.DataObject, seed: int) -> None:
    """With a one-hot target, MSS accepts a valid argmax path; greedy verification (which prefers
    the deeper of duplicate matching siblings) accepts one at least as long."""
    v = 4
    n = len(parents)
    tree = compile_tree(parents)
    tokens = data.draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    argmax = data.draw(st.lists(st.integers(0, v - 1), min_size=n + 1, max_size=n + 1))
    tok_t = torch.tensor(tokens, dtype=torch.long)
    path, nxt = verify_tree_greedy(torch.tensor(argmax), tree, tok_t)
    _greedy_path_valid(argmax, tree, tokens, path, nxt)
    p = torch.nn.functional.one_hot(torch.tensor(argmax), v).float()  # [N+1, V]
    q = torch.full((n, v), 1.0 / v)
    for proposals in (None, q):
        mss_path, mss_next = verify_tree(p, tree, tok_t, proposals, _gen(seed))
        _greedy_path_valid(argmax, tree, tokens, mss_path, mss_next)
        assert len(path) >= len(mss_path)
        if len(set(tokens)) == n:  # no duplicate tokens: the matching path is unique
            assert (mss_path, mss_next) == (path, nxt)


# --- MSS: joint distribution of the first two output tokens ------------------------------------

def _rand_dist(rng: np.random.Generator, shape: tuple[int, ...], v: int, zeros: int = 0) -> np.ndarray:
    """Dirichlet rows [*shape, V]; ``zeros`` random entries per row set to 0 (renormalised)."""
    d = rng.dirichlet(np.ones(v), size=shape)
    if zeros:
        idx = np.argsort(rng.random((*shape, v)), axis=-1)[..., :zeros]
        np.put_along_axis(d, idx, 0.0, axis=-1)
        d /= d.sum(-1, keepdims=True)
    return d


@dataclass
class _Model:
    """p(next | history) for any history: rows for lengths 0, 1, 2, deeper by the last token."""

    root: np.ndarray  # [V]
    after1: np.ndarray  # [V, V]
    after2: np.ndarray  # [V, V, V]
    deep: np.ndarray  # [V, V]

    @classmethod
    def random(cls, rng: np.random.Generator, v: int, zeros: int = 0) -> "_Model":
        return cls(_rand_dist(rng, (), v, zeros), _rand_dist(rng, (v,), v, zeros),
                   _rand_dist(rng, (v, v), v, zeros), _rand_dist(rng, (v,), v, zeros))

    def __post_init__(self) -> None:
        self._cdf: dict[tuple[int, ...], np.ndarray] = {}
        self._order: dict[tuple[int, ...], np.ndarray] = {}

    def cdf(self, hist: tuple[int, ...]) -> np.ndarray:
        if hist not in self._cdf:
            self._cdf[hist] = np.cumsum(self(hist))
        return self._cdf[hist]

    def order(self, hist: tuple[int, ...]) -> np.ndarray:
        """Tokens by decreasing probability (ties: lowest id first)."""
        if hist not in self._order:
            self._order[hist] = np.argsort(-self(hist), kind="stable")
        return self._order[hist]

    def __call__(self, hist: tuple[int, ...]) -> np.ndarray:
        if len(hist) == 0:
            return self.root
        if len(hist) == 1:
            return self.after1[hist[0]]
        if len(hist) == 2:
            return self.after2[hist[0], hist[1]]
        return self.deep[hist[-1]]


@dataclass(frozen=True)
class _Config:
    target: _Model
    draft: _Model
    depth: int
    widths: tuple[int, ...]  # each node's number of children is drawn uniformly from these
    sampled: bool = True  # children iid from the draft (duplicates allowed); else distinct top-w


def _random_shape(cfg: _Config, rng: np.random.Generator, dfs: bool) -> tuple[int, ...]:
    """Parents of a random tree (root has >= 1 child), numbered breadth- or depth-first."""
    def grow(depth: int, is_root: bool) -> list:
        if depth == cfg.depth:
            return []
        w = int(rng.choice(cfg.widths))
        return [grow(depth + 1, False) for _ in range(max(w, 1) if is_root else w)]

    parents: list[int] = []
    if dfs:
        def number(kids: list, me: int) -> None:
            for sub in kids:
                parents.append(me)
                number(sub, len(parents) - 1)
        number(grow(0, True), -1)
    else:
        frontier = [(-1, grow(0, True))]
        while frontier:
            nxt = []
            for me, kids in frontier:
                for sub in kids:
                    parents.append(me)
                    nxt.append((len(parents) - 1, sub))
            frontier = nxt
    return tuple(parents)


def _draft_tree(cfg: _Config, parents: tuple[int, ...], hist: tuple[int, ...],
                rng: np.random.Generator):
    """Fill the tree shape ``parents`` below ``hist`` with draft tokens: each node's token is drawn
    from the draft at its parent's history (or, deterministic, the parent's k-th most likely draft
    token for its k-th child). Returns (tokens, q rows [N], p rows [N+1], row 0 = root)."""
    hists = [hist]
    tokens: list[int] = []
    q_rows: list[np.ndarray] = []
    p_rows = [cfg.target(hist)]
    nth_child = [0] * (len(parents) + 1)
    u = rng.random(len(parents))
    for i, par in enumerate(parents):
        h = hists[par + 1]
        qd = cfg.draft(h)
        if cfg.sampled:
            t = int(np.searchsorted(cfg.draft.cdf(h), u[i], side="right"))
            if t >= len(qd) or qd[t] == 0:  # float edge at the top of the cdf
                t = int(np.flatnonzero(qd)[-1])
        else:
            t = int(cfg.draft.order(h)[nth_child[par + 1]])
            nth_child[par + 1] += 1
        tokens.append(t)
        q_rows.append(qd)
        hists.append(h + (t,))
        p_rows.append(cfg.target(h + (t,)))
    return tokens, q_rows, p_rows


def _verify_round(cfg: _Config, parents: tuple[int, ...], hist: tuple[int, ...],
                  rng: np.random.Generator, gen: torch.Generator) -> list[int]:
    """One decode iteration at ``hist``: draft a tree, verify it; returns the emitted tokens."""
    tokens, q_rows, p_rows = _draft_tree(cfg, parents, hist, rng)
    tree = compile_tree(parents)
    p = torch.from_numpy(np.stack(p_rows)).float()  # [N+1, V]
    q = torch.from_numpy(np.stack(q_rows)).float() if cfg.sampled else None  # [N, V]
    path, nxt = verify_tree(p, tree, torch.tensor(tokens, dtype=torch.long), q, gen)
    # structural sanity: the accepted nodes form a root-to-node path
    row = 0
    for node in path:
        assert node in tree.children[row]
        row = node + 1
    assert p[row, nxt] > 0  # never emits a token the target rules out
    return [tokens[i] for i in path] + [nxt]


def _first_two_counts(cfg: _Config, trials: int, seed: int, n_shapes: int = 24) -> np.ndarray:
    """(t1, t2) counts over ``trials`` simulated decodes; tree shapes come from a pool of
    ``n_shapes`` random shapes (so compiled trees are cached), tokens are fresh every round."""
    v = cfg.target.root.shape[0]
    rng = np.random.default_rng(seed)
    gen = _gen(seed)
    shapes = [_random_shape(cfg, rng, dfs=bool(k % 2)) for k in range(n_shapes)]
    picks = rng.integers(0, n_shapes, size=(trials, 2))
    counts = np.zeros((v, v), dtype=np.int64)
    for k in range(trials):
        out = _verify_round(cfg, shapes[picks[k, 0]], (), rng, gen)
        if len(out) == 1:  # nothing accepted: the next decode iteration, fresh tree at (t1,)
            out += _verify_round(cfg, shapes[picks[k, 1]], (out[0],), rng, gen)
        counts[out[0], out[1]] += 1
    return counts


def _pooled_chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; impossible cells must be empty, cells with expected < 5 are pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    support = probs > 0
    assert counts[~support].sum() == 0, f"impossible outcomes drawn at {np.flatnonzero(counts * ~support)}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    obs = counts[support]
    small = expected < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(obs) == 1:
        return 1.0
    return float(chisquare(obs, expected).pvalue)


def _joint(target: _Model) -> np.ndarray:
    return target.root[:, None] * target.after1  # [V, V]: p(a) p(b | a)


def _configs() -> dict[str, _Config]:
    rng = np.random.default_rng(2024)
    v = 6
    rand_p, rand_q = _Model.random(rng, v, zeros=1), _Model.random(rng, v)
    zq_p, zq_q = _Model.random(rng, v, zeros=1), _Model.random(rng, v, zeros=3)
    same = _Model.random(rng, v)
    det_p, det_q = _Model.random(rng, v), _Model.random(rng, v)
    chain_p, chain_q = _Model.random(rng, v, zeros=1), _Model.random(rng, v, zeros=2)
    return {
        "random": _Config(rand_p, rand_q, depth=3, widths=(0, 1, 2, 3)),
        "q_zeros_where_p_positive": _Config(zq_p, zq_q, depth=3, widths=(0, 1, 2, 3)),
        "p_equals_q": _Config(same, same, depth=3, widths=(0, 1, 2, 3)),
        "deterministic_top_w": _Config(det_p, det_q, depth=3, widths=(0, 1, 2, 3), sampled=False),
        "chain": _Config(chain_p, chain_q, depth=3, widths=(1,)),
        "wide_root_only": _Config(rand_p, rand_q, depth=1, widths=(3,)),
    }


_CONFIGS = _configs()


def test_configs_exercise_intended_cases() -> None:
    zq = _CONFIGS["q_zeros_where_p_positive"]
    assert np.any((zq.draft.root == 0) & (zq.target.root > 0))
    assert np.any((zq.draft.after1 == 0) & (zq.target.after1 > 0))
    assert np.any(_joint(zq.target) == 0)  # impossible cells exist
    same = _CONFIGS["p_equals_q"]
    assert same.target is same.draft


@pytest.mark.parametrize("case", sorted(_CONFIGS))
def test_mss_first_two_tokens_match_target(case: str) -> None:
    cfg = _CONFIGS[case]
    counts = _first_two_counts(cfg, N_TRIALS, seed=sorted(_CONFIGS).index(case) + 100)
    assert _pooled_chisquare_pvalue(counts, _joint(cfg.target)) > P_MIN


def test_mss_p_equals_q_accepts_first_child_down_to_a_leaf() -> None:
    """p == q: every first child is accepted (min(1, p/q) = 1), so the path reaches a leaf."""
    cfg = _CONFIGS["p_equals_q"]
    rng, gen = np.random.default_rng(7), _gen(7)
    for k in range(200):
        parents = _random_shape(cfg, rng, dfs=bool(k % 2))
        tree = compile_tree(parents)
        tokens, q_rows, p_rows = _draft_tree(cfg, parents, (), rng)
        path, _ = verify_tree(torch.from_numpy(np.stack(p_rows)).float(), tree,
                              torch.tensor(tokens), torch.from_numpy(np.stack(q_rows)).float(), gen)
        row = 0
        for node in path:
            assert node == tree.children[row][0]
            row = node + 1
        assert tree.children[row] == ()


def test_chi_square_has_power_against_missing_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not updating p to the residual after a rejected child must fail the same test."""
    monkeypatch.setattr(tree_verify, "residual", lambda p_, q_: p_)
    cfg = _CONFIGS["wide_root_only"]
    counts = _first_two_counts(cfg, N_TRIALS, seed=sorted(_CONFIGS).index("wide_root_only") + 100)
    assert _pooled_chisquare_pvalue(counts, _joint(cfg.target)) < 1e-6


def test_single_level_duplicate_children_marginal() -> None:
    """Three root children, binary vocab (so duplicates are frequent): the first-token marginal
    is still exactly p, for deterministic proposals (all three children the same token) and for
    children drawn iid from q."""
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    tree = compile_tree((-1, -1, -1))
    q = torch.tensor([[0.9, 0.1]] * 3)
    for proposals in ("deterministic", "sampled"):
        gen = _gen(5)
        firsts = np.zeros(2, dtype=np.int64)
        for _ in range(4000):
            if proposals == "deterministic":
                tokens = torch.tensor([0, 0, 0])
                path, nxt = verify_tree(p, tree, tokens, None, gen)
            else:
                tokens = torch.multinomial(q, 1, generator=gen).squeeze(-1)  # [3], iid ~ q
                path, nxt = verify_tree(p, tree, tokens, q, gen)
            firsts[int(tokens[path[0]]) if path else nxt] += 1
        assert _pooled_chisquare_pvalue(firsts, np.array([0.5, 0.5])) > P_MIN, proposals


# --- errors ------------------------------------------------------------------------------------

def test_token_with_zero_proposal_probability_raises() -> None:
    p = torch.full((3, 3), 1.0 / 3)
    tree = compile_tree((-1, 0))
    q = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    with pytest.raises(ValueError, match="proposal probability 0"):
        verify_tree(p, tree, torch.tensor([2, 0]), q, _gen(0))
    # second sibling with q = 0, reached after the first is certainly rejected (p[x] = 0)
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3] * 3, [1 / 3] * 3])
    tree = compile_tree((-1, -1))
    q = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match="node 1"):
        verify_tree(p, tree, torch.tensor([0, 2]), q, _gen(0))


def test_verify_tree_no_global_rng_use() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    cfg = _CONFIGS["random"]
    _verify_round(cfg, (-1, -1, 0, 1, 1), (), np.random.default_rng(0), _gen(0))
    assert torch.equal(before, torch.get_rng_state())
