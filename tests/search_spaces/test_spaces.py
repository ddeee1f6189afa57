import warnings

import optuna
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from search_spaces import (
    PLAIN, SPACES, SpaceContext, SpaceError, Strategy, easyspec_plan, get_space, uniform_skip_plan, uniform_strategy,
)
from search_spaces.spaces import TREE_SHAPES, LayerSkipSpace
from search_spaces.strategy import DEFAULT_TREE_WIDTHS, SWIFT_DYNAMIC_WIDTHS

optuna.logging.set_verbosity(optuna.logging.WARNING)

BASES = [
    Strategy(),
    PLAIN,
    Strategy(draft_length=10, tree_widths=DEFAULT_TREE_WIDTHS, confidence_threshold=0.33, calibrate=False),
    Strategy(draft_length=4, dynamic_widths=SWIFT_DYNAMIC_WIDTHS, draft_precision="float32"),
]
contexts = st.builds(
    SpaceContext,
    n_layers=st.integers(3, 40),
    base=st.sampled_from(BASES),
    skip_ratio=st.floats(0.0, 0.95),
    max_draft_length=st.integers(2, 25),
    draft_layers=st.one_of(st.none(), st.integers(1, 40)),
)


def fixed(space, params, ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FixedTrial warns on values outside a distribution
        return space.define(optuna.trial.FixedTrial(params), ctx)


def check_invariants(name, s, ctx):
    """Everything a space promises about its strategies."""
    assert Strategy.from_json(s.to_json()) == s  # valid
    if name == "auto":
        check_auto(s, ctx)
        return
    if name == "chain":
        assert s == PLAIN or (s.tree_widths is None and s.layer_plan is None and s.draft_length in (2, 4, 6, 8, 10, 12))
        assert s in get_space("chain").points(ctx)
        return
    assert 2 <= s.draft_length <= ctx.max_draft_length
    assert s.tree_widths is None or len(s.tree_widths) == s.draft_length
    assert s.draft_precision == ctx.base.draft_precision and s.draft_vocab == ctx.base.draft_vocab
    plan = s.layer_plan
    if name.startswith("layer-skip"):
        assert s.drafter == "layer-skip" and plan.n_layers == ctx.n_layers and not plan.groups
        skipped = plan.skip_attn + plan.skip_mlp
        assert skipped and 0 not in skipped and ctx.n_layers - 1 not in skipped
        if name == "layer-skip":
            assert len(skipped) == LayerSkipSpace.skip_count(ctx)
            assert len(skipped) == min(2 * (ctx.n_layers - 2), max(1, round(ctx.skip_ratio * 2 * ctx.n_layers)))
    elif name == "easyspec":
        assert s.drafter == "draft-model"
        if plan is not None:
            assert plan.groups and not plan.skip_attn and not plan.skip_mlp and plan.n_layers == ctx.n_layers
            assert all(0 < first < last < ctx.n_layers - 1 for first, last in plan.groups)
            assert max(last - first + 1 for first, last in plan.groups) <= 4
    elif name == "draft":
        assert s.drafter == "draft-model" and plan is None
    else:
        assert s.drafter == "prompt-lookup" and plan is None and s.tree_widths is None
    if name != "draft" and s.drafter != "prompt-lookup":
        assert s.dynamic_widths == ctx.base.dynamic_widths
    if 0.0 < s.confidence_threshold and name != "lookup":
        assert s.confidence_threshold <= 0.9 + 1e-9


def check_auto(s, ctx):
    """The joint space: a kind of this context, each branch within its named space's ranges."""
    assert s.drafter in get_space("auto").kinds(ctx)
    if s == PLAIN:
        return
    assert 2 <= s.draft_length <= ctx.max_draft_length
    assert s.dynamic_widths is None and s.max_tree_nodes <= ctx.max_draft_length
    if s.drafter == "draft-model":
        assert ctx.draft_layers is not None and s.draft_precision == ctx.base.draft_precision
        assert s.tree_widths is None or (len(s.tree_widths) == s.draft_length and set(s.tree_widths[2:]) <= {1})
        assert s.layer_plan is None or (s.layer_plan.n_layers == ctx.draft_layers and s.layer_plan.groups)
    elif s.drafter == "layer-skip":
        assert ctx.draft_layers is None and s.tree_widths is None
        assert len(s.layer_plan.skip_attn + s.layer_plan.skip_mlp) == LayerSkipSpace.skip_count(ctx)
    else:
        assert s.drafter == "prompt-lookup" and s.layer_plan is None and s.tree_widths is None


def test_auto_offers_plain_lookup_and_the_drafting_model():
    space = get_space("auto")
    assert space.kinds(SpaceContext(n_layers=12, draft_layers=6)) == ("none", "prompt-lookup", "draft-model")
    assert space.kinds(SpaceContext(n_layers=12)) == ("none", "prompt-lookup", "layer-skip")
    assert uniform_strategy("auto", SpaceContext(n_layers=12)) == PLAIN  # plain decoding: the start
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    ctx = SpaceContext(n_layers=12, draft_layers=6, max_draft_length=12)
    seen = set()
    for _ in range(200):
        trial = study.ask()
        s = get_space("auto").define(trial, ctx)
        seen.add((s.drafter, s.tree_widths is not None, s.layer_plan is not None))
        assert set(trial.params) <= {"drafter"} | {p for p in trial.params if p[:3] == {"draft-model": "dm_",
                                     "prompt-lookup": "lk_", "none": "---"}[s.drafter]}
        study.tell(trial, 1.0)
    assert {("none", False, False), ("prompt-lookup", False, False), ("draft-model", True, True),
            ("draft-model", False, False)} <= seen  # plain, lookup, trees, chains, layer-parallel plans
    with pytest.raises(SpaceError, match="holds"):
        get_space("auto").encode(Strategy(drafter="layer-skip", layer_plan=uniform_skip_plan(12, 0.4)), ctx)


@pytest.mark.parametrize("name", list(SPACES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts, seed=st.integers(0, 2**16))
def test_random_trials_round_trip_and_hold_invariants(name, ctx, seed):
    space = get_space(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(8):
        trial = study.ask()
        s = space.define(trial, ctx)
        check_invariants(name, s, ctx)
        params = space.encode(s, ctx)
        assert fixed(space, params, ctx) == s
        study.tell(trial, float(s.draft_length))


@pytest.mark.parametrize("name", list(SPACES))
@settings(max_examples=25, deadline=None)
@given(ctx=contexts)
def test_uniform_strategy_round_trips(name, ctx):
    u = uniform_strategy(name, ctx)
    check_invariants(name, u, ctx)
    assert fixed(get_space(name), get_space(name).encode(u, ctx), ctx) == u


@pytest.mark.parametrize("name", list(SPACES))
def test_uniform_strategy_is_the_first_enqueued_trial(name):
    ctx = SpaceContext(n_layers=12)
    space, u = get_space(name), uniform_strategy(name, ctx)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial(space.encode(u, ctx))
    assert space.define(study.ask(), ctx) == u


def test_uniform_references_follow_the_papers():
    ctx = SpaceContext(n_layers=28, base=Strategy(draft_length=10, calibrate=False), skip_ratio=0.45)
    free = uniform_strategy("layer-skip-free", ctx)
    assert free.layer_plan == uniform_skip_plan(28, 0.45)
    fixed_count = uniform_strategy("layer-skip", ctx).layer_plan
    assert len(fixed_count.skip_attn + fixed_count.skip_mlp) == round(0.45 * 56) == 25  # one MLP of 26 runs
    assert set(fixed_count.skip_attn) | set(fixed_count.skip_mlp) <= set(free.layer_plan.skip_attn)
    easy = uniform_strategy("easyspec", ctx)
    assert easy.layer_plan.groups == easyspec_plan(28, 4).groups and easy.calibrate
    assert uniform_strategy("draft", ctx) == ctx.base
    tree_base = Strategy(tree_widths=DEFAULT_TREE_WIDTHS)
    assert uniform_strategy("draft", SpaceContext(n_layers=28, base=tree_base)) == tree_base
    assert uniform_strategy("lookup", ctx) == Strategy(drafter="prompt-lookup", draft_length=10, calibrate=False)


def test_tree_menu_shapes_fit_every_draft_length():
    ctx = SpaceContext(n_layers=6, max_draft_length=25)
    for tree in TREE_SHAPES:
        for length in (2, 25):
            s = fixed(get_space("draft"), {"tree": tree, "draft_length": length, "confidence_threshold": 0.0}, ctx)
            assert get_space("draft").encode(s, ctx)["tree"] == tree
    two = fixed(get_space("draft"), {"tree": "2-2-1", "draft_length": 4, "confidence_threshold": 0.5}, ctx)
    assert two.tree_widths == (2, 2, 1, 1)


def test_free_space_skipping_nothing_skips_a_middle_attention():
    ctx = SpaceContext(n_layers=8)
    params = {f"skip_{kind}_{i}": 0 for i in range(1, 7) for kind in ("attn", "mlp")}
    s = fixed(get_space("layer-skip-free"), {**params, "draft_length": 4, "confidence_threshold": 0.0}, ctx)
    assert (s.layer_plan.skip_attn, s.layer_plan.skip_mlp) == ((4,), ())


def test_score_ties_skip_lower_sub_layers_first():
    ctx = SpaceContext(n_layers=5, skip_ratio=0.3)  # round(3.0) = 3 of 6 sub-layers
    scores = {f"s_{kind}_{i}": 0.5 for i in range(1, 4) for kind in ("attn", "mlp")}
    s = fixed(get_space("layer-skip"), {**scores, "draft_length": 3, "confidence_threshold": 0.1}, ctx)
    assert (s.layer_plan.skip_attn, s.layer_plan.skip_mlp) == ((1, 2), (1,))


def test_unknown_space_names_the_known_ones():
    with pytest.raises(SpaceError, match="known spaces: auto, layer-skip, layer-skip-free, easyspec, draft, lookup, chain"):
        get_space("swift")
    with pytest.raises(ValueError):
        uniform_strategy("nope", SpaceContext(n_layers=4))


@pytest.mark.parametrize(
    "name,strategy",
    [
        ("layer-skip", Strategy(drafter="draft-model")),
        ("layer-skip", Strategy(drafter="layer-skip", layer_plan=uniform_skip_plan(10, 0.1))),  # wrong count
        ("layer-skip-free", Strategy(drafter="layer-skip", layer_plan=uniform_skip_plan(12, 0.5))),  # other model
        ("draft", Strategy(draft_length=3, tree_widths=(3, 3, 3))),  # not in the tree menu
        ("draft", Strategy(draft_length=20)),  # beyond max_draft_length
        ("easyspec", Strategy(layer_plan=easyspec_plan(10, 4), draft_precision="int8")),  # untuned field
        ("lookup", Strategy(drafter="prompt-lookup", draft_length=1)),
    ],
)
def test_encode_rejects_strategies_outside_the_space(name, strategy):
    with pytest.raises(SpaceError):
        get_space(name).encode(strategy, SpaceContext(n_layers=10))


def test_bad_contexts():
    for bad in (dict(n_layers=0), dict(n_layers=4, skip_ratio=1.0), dict(n_layers=4, max_draft_length=26),
                dict(n_layers=4, max_draft_length=1)):
        with pytest.raises(SpaceError):
            SpaceContext(**bad)
    with pytest.raises(SpaceError, match="at least 3 layers"):
        uniform_strategy("layer-skip", SpaceContext(n_layers=2))


def test_gp_sampler_drives_the_layer_skip_space():
    ctx = SpaceContext(n_layers=6, max_draft_length=8)
    space = get_space("layer-skip")
    assert not space.conditional
    study = optuna.create_study(sampler=optuna.samplers.GPSampler(seed=0, n_startup_trials=2))
    study.enqueue_trial(space.encode(uniform_strategy("layer-skip", ctx), ctx))
    for _ in range(5):
        trial = study.ask()
        s = space.define(trial, ctx)
        check_invariants("layer-skip", s, ctx)
        study.tell(trial, s.draft_length * (1.0 - s.confidence_threshold) + len(s.layer_plan.skip_attn))
    assert len(study.trials) == 5


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("multivariate", [False, True])
@pytest.mark.parametrize("name", [n for n, s in SPACES.items() if s.conditional] + ["draft"])
def test_tpe_sampler_drives_conditional_spaces(name, multivariate):
    assert get_space("easyspec").conditional
    ctx = SpaceContext(n_layers=14)
    space = get_space(name)
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=3, multivariate=multivariate, group=multivariate)
    )
    for _ in range(12):
        trial = study.ask()
        s = space.define(trial, ctx)
        check_invariants(name, s, ctx)
        assert fixed(space, space.encode(s, ctx), ctx) == s
        study.tell(trial, float(s.draft_length))


def test_chain_space_points_are_a_small_enumerable_grid():
    space = get_space("chain")
    ctx = SpaceContext(n_layers=28, draft_layers=24, max_draft_length=12)
    points = space.points(ctx)
    assert len(points) == len(set(points)) == 1 + 6 * 3 + 6  # plain, chain length x threshold, lookup length
    assert points[0] == PLAIN and {s.drafter for s in points} == {"none", "draft-model", "prompt-lookup"}
    for s in points:
        assert fixed(space, space.encode(s, ctx), ctx) == s
    no_draft = space.points(SpaceContext(n_layers=28, max_draft_length=6))
    assert [s.drafter for s in no_draft] == ["none"] + ["prompt-lookup"] * 3
    # seeds: plain, then one point per drafter kind, so the tuner sweeps both free families
    seeds = space.seeds(ctx)
    assert seeds[0] == PLAIN and [s.drafter for s in seeds[1:]] == ["draft-model", "prompt-lookup"]
    assert all(s in points and s.layer_plan is None for s in seeds)
    assert [s.drafter for s in space.seeds(SpaceContext(n_layers=28, max_draft_length=6))] == ["none", "prompt-lookup"]


def test_neighbours_are_points_of_the_space_with_the_same_plan():
    ctx = SpaceContext(n_layers=28, draft_layers=24, max_draft_length=12)
    auto = get_space("auto")
    near = auto.neighbours(Strategy(draft_length=10, confidence_threshold=0.6), ctx)
    assert {(s.draft_length, s.confidence_threshold, s.tree_widths) for s in near} == {
        (8, 0.6, None), (12, 0.6, None), (10, 0.5, None), (10, 0.7, None),
        (6, 0.6, (2, 1, 1, 1, 1, 1)),  # a second candidate at depth 1, cut to the node budget (12)
    }
    tree = Strategy(draft_length=4, confidence_threshold=0.6, tree_widths=(2, 1, 1, 1))
    assert {(s.draft_length, s.tree_widths) for s in auto.neighbours(tree, ctx)} == {
        (2, (2, 1)), (6, (2, 1, 1, 1, 1, 1)), (4, (2, 1, 1, 1)), (4, None), (4, (3, 1, 1, 1))}
    assert [s.draft_length for s in auto.neighbours(Strategy(drafter="prompt-lookup", draft_length=12), ctx)] == [10]
    assert auto.neighbours(PLAIN, ctx) == []
    for s in near:
        assert fixed(auto, auto.encode(s, ctx), ctx) == s and s.layer_plan is None
    # the grid space keeps its grid: thresholds +-0.1 are not points of it
    grid = get_space("chain").neighbours(Strategy(draft_length=10, confidence_threshold=0.6), ctx)
    assert {(s.draft_length, s.confidence_threshold) for s in grid} == {(8, 0.6), (12, 0.6)}
