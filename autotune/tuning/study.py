"""``autotune study``: decode a task's prompts while tuning the strategy online, persist the best.

1. ``split_prompts`` (``autotune.tuning.heldout``): every third prompt (at least two where there
   are enough) is held out of tuning.
2. ``_build``, ``_tune``: on the other prompts plain decoding runs first, every drafter kind of the
   space following the sequence on standby; the online tuner (``autotune.tuning.tuner``) scores
   candidates between rounds, races them on fresh windows and switches only to one that measured
   faster; trials go to Optuna's RDB storage (one study per model, draft, task, space and
   hardware; resumed when it exists, its best tried first). The default space is ``auto`` (plain /
   prompt lookup / the draft model or the target's own layers, with trees, lengths, thresholds,
   layer-parallel groups and calibration).
3. ``_judge``: plain decoding, the tuner's incumbent and the best-scored candidate of each other
   drafter kind (``runner_ups``) decode the held-out prompts, interleaved; the one with the
   highest lower bound on its per-prompt speed-up is chosen (plain decoding wins ties; a
   candidate whose output differed is never chosen), and its held-out speed-up is what the study
   reports.
4. ``_record``: the chosen strategy is recorded in the strategy store (best row + history, with the
   held-out speed-up, + the routing texts of the prompts decoded, which ``autotune serve`` routes
   requests by) in one transaction; every candidate's per-prompt speed-ups go to the study's
   ``heldout`` attribute, which ``autotune report`` plots.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from tqdm import tqdm

from autotune.errors import SettingError, StorageError
from autotune.store.records import ResultMetrics, StrategyKey
from autotune.store.resolve import strategy_key
from autotune.timing import Stopwatch
from autotune.tuning.cost_model import MeasuredCostModel
from autotune.tuning.candidates import price_text, runner_ups
from autotune.tuning.heldout import Candidate, Verdict, choose, judge_on, plain_candidate, split_prompts
from autotune.tuning.tuner import OnlineTuner, TunerSettings
from runtime.decoding import Decoder, GenerationConfig
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool, build_decoder, default_draft
from runtime.stats import DecodeStats
from search_spaces.layer_plan import SKIP_RATIO, uniform_skip_plan
from search_spaces.spaces import TREE_SHAPES, SearchSpace, SpaceContext, get_space, uniform_strategy
from search_spaces.strategy import PLAIN, Strategy, tree_node_bound

# `autotune study` with no --model: the packaged Qwen2.5-Coder pair on HumanEval (no data files needed)
DEFAULT_MODEL, DEFAULT_DRAFT, DEFAULT_TASK = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "humaneval"
DEFAULT_SPACE = "auto"  # the joint space: plain / prompt lookup / the drafting model, with or without --draft
# the named subset a bench's `uniform` method starts from (EasySpec's plan, SWIFT's uniform skip)
REFERENCE_SPACE = {"draft-model": "easyspec", "layer-skip": "layer-skip"}
MAX_DRAFT_LENGTH = 12


def default_space(draft: str | None) -> str:
    return DEFAULT_SPACE


def reference_space(draft: str | None) -> str:
    return REFERENCE_SPACE["draft-model" if draft else "layer-skip"]


def check_space_choice(space: SearchSpace, draft: str | None) -> None:
    """Whether ``space`` can be tuned online with (or without) a draft model; fails before any load."""
    if space.drafter == "draft-model" and draft is None:
        raise SettingError(f"search space '{space.name}' tunes a draft model; pass --draft MODEL")
    if space.drafter == "layer-skip" and draft is not None:
        raise SettingError(f"search space '{space.name}' drafts with the target itself; drop --draft")


def space_context(space: SearchSpace, target: LoadedModel, draft: LoadedModel | None, skip_ratio: float) -> SpaceContext:
    check_space_choice(space, None if draft is None else draft.model_id)
    target_layers = target.hf_model.config.num_hidden_layers
    draft_layers = None if draft is None else draft.hf_model.config.num_hidden_layers
    if space.drafter == "layer-skip":
        base = Strategy(drafter="layer-skip", layer_plan=uniform_skip_plan(target_layers, skip_ratio))
        return SpaceContext(n_layers=target_layers, base=base, skip_ratio=skip_ratio, max_draft_length=MAX_DRAFT_LENGTH)
    if space.drafter == "draft-model":
        assert draft_layers is not None
        return SpaceContext(n_layers=draft_layers, skip_ratio=skip_ratio, max_draft_length=MAX_DRAFT_LENGTH)
    return SpaceContext(n_layers=target_layers, skip_ratio=skip_ratio, max_draft_length=MAX_DRAFT_LENGTH,
                        draft_layers=draft_layers)


def standby_strategies(space: SearchSpace, ctx: SpaceContext) -> list[Strategy]:
    """One strategy per drafter kind of the space: the tuning decoder holds each kind's drafter
    (following the sequence while plain decoding runs) and ``Decoder.apply`` reconfigures it."""
    out = []
    for kind in space.kinds(ctx):
        if kind == "layer-skip":
            out.append(Strategy(drafter=kind, layer_plan=uniform_skip_plan(ctx.n_layers, ctx.skip_ratio)))
        elif kind in ("draft-model", "prompt-lookup"):
            out.append(Strategy(drafter=kind))
    return out


def verify_width(space: SearchSpace, ctx: SpaceContext) -> int:
    """One verify width for every strategy of the space (one packed copy of the target)."""
    bound = ctx.max_draft_length
    if space.name == "draft":
        for head, dynamic in TREE_SHAPES.values():
            widths = (tuple(head) + (1,) * ctx.max_draft_length)[: ctx.max_draft_length] if head else (1,) * ctx.max_draft_length
            bound = max(bound, tree_node_bound(widths, dynamic))
    return bound + 1


def study_name(key: StrategyKey, space: str) -> str:
    draft = f"+{key.draft_id}" if key.draft_id else ""
    return f"{key.model_id}{draft}|{key.task}|{space}|{key.hardware}"


@dataclass
class StudyReport:
    name: str
    space: str
    best: Strategy  # the tuner's incumbent
    chosen: Strategy  # what was stored: the held-out judgement's winner (``autotune.tuning.heldout``)
    uniform: Strategy
    tuner: dict[str, Any]
    tune_stats: DecodeStats
    verdict: Verdict  # plain decoding, the incumbent and the runner-ups on the held-out prompts
    tuning_share: float
    storage_url: str
    tuned_prompts: int = 0
    # ``baseline=True``: plain decoding of every prompt tuned on, interleaved with the tuning
    # decoder (:class:`Baseline`); None otherwise
    baseline: "Baseline | None" = None
    history_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stored_reason(self) -> str:
        return self.verdict.reason

    @property
    def identical(self) -> bool:
        """Every candidate's output equalled plain decoding's on every held-out prompt (and, with
        ``baseline``, the tuning decoder's on every tuned one)."""
        return all(c.identical for c in self.verdict.candidates) and (self.baseline is None or self.baseline.identical)

    @property
    def refused(self) -> bool:
        """A speculating candidate's output differed from plain decoding, so it was not stored."""
        return not self.identical

    @property
    def plain_tps(self) -> float:
        return self.verdict.plain.stats.tokens_per_s

    @property
    def chosen_tps(self) -> float:
        return self.verdict.chosen.stats.tokens_per_s

    @property
    def speedup(self) -> float:
        """The stored strategy's speed-up over plain decoding on the held-out prompts."""
        return self.verdict.speedup

    @property
    def in_sample_speedup(self) -> float | None:
        """The tuner's predicted speed-up of its incumbent on the prompts it tuned on (in-sample)."""
        plain, best = self.tuner.get("plain_predicted_tps"), self.tuner.get("best_predicted_tps")
        return best / plain if plain and best else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "study": self.name, "space": self.space, "best": self.best.to_dict(), "chosen": self.chosen.to_dict(),
            "uniform": self.uniform.to_dict(), "tuner": self.tuner, "tune_stats": self.tune_stats.as_dict(),
            "plain_tps": self.plain_tps, "chosen_tps": self.chosen_tps, "speedup": self.speedup,
            "heldout": self.verdict.as_dict(), "in_sample_speedup": self.in_sample_speedup,
            "tuned_prompts": self.tuned_prompts, "identical": self.identical,
            "tuning_share": self.tuning_share, "storage": self.storage_url, "stored_reason": self.stored_reason,
            "refused": self.refused,
            "baseline": self.baseline.as_dict() if self.baseline else None,
        }


@dataclass
class Baseline:
    """Plain decoding on the study's own prompts, each decoded next to the tuning decoder (before
    it on even prompts, after it on odd ones, so going first or second cancels), in the same
    minutes (this machine's speed drifts by more than the effects measured), prefill included on
    both sides."""

    plain: DecodeStats
    tuning: DecodeStats
    identical: bool  # every output of the tuning decoder equalled plain decoding's

    @property
    def ratio(self) -> float:
        return self.tuning.tokens_per_s / self.plain.tokens_per_s if self.plain.tokens_per_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"plain_tps": self.plain.tokens_per_s, "tuning_tps": self.tuning.tokens_per_s, "ratio": self.ratio,
                "identical": self.identical, "tokens": self.tuning.new_tokens,
                # prefill, verify and draft time of each side: where a gap between them comes from
                "plain_stats": self.plain.as_dict(), "tuning_stats": self.tuning.as_dict()}


def run_study(
    pool: ModelPool, target: LoadedModel, draft_name: str | None, task: str, prompts: list[list[int]],
    cfg: GenerationConfig, storage: Any, space_name: str, settings: TunerSettings, skip_ratio: float = SKIP_RATIO,
    progress: bool = True, prompt_texts: Sequence[str] = (), baseline: bool = False,
) -> StudyReport:
    """Tune on ``prompts`` (token ids) less the held-out ones (``split_prompts``), judge on those,
    and record the result; ``prompt_texts`` are the routing texts of all of them
    (``studies.routing_text``), stored with the result for the server's task router.
    ``baseline``: decode every tuned prompt plainly too, next to tuning on it (``Baseline``:
    tokens/s while tuning against plain decoding's on the same prompts, and token identity of
    every output, which joins the lossless check of what is stored); its time is not tuning time."""
    tuned_idx, held_idx = split_prompts(len(prompts))
    tuned = [prompts[i] for i in tuned_idx]
    held = [prompts[i] for i in held_idx] or tuned[:1]  # one prompt: judged in-sample, and said so
    setup = _build(pool, target, draft_name, task, tuned, cfg, storage, space_name, settings, skip_ratio)
    stats, base, tuning_share = _tune(setup, pool, target, tuned, cfg, progress, baseline)
    try:  # refreshed by the decode; a cache: a store that cannot take them loses nothing else
        storage.keep_costs(setup.key, setup.tuner.cost.shape, setup.tuner.cost.timings())
    except StorageError as exc:
        print(f"autotune study: the cost model's timings were not kept ({exc}); the next study times them again",
              file=sys.stderr)
    verdict = _judge(pool, target, setup, held, cfg, in_sample=not held_idx)
    report = _record(setup, storage, verdict, stats, base, tuning_share, prompt_texts, len(tuned))
    report.extra["precision"] = _precision_advice(pool, target, setup, report, prompts, cfg)
    setup.study.set_user_attr("precision", report.extra["precision"])
    return report


def _precision_advice(
    pool: ModelPool, target: LoadedModel, setup: _Setup, report: StudyReport, prompts: list[list[int]],
    cfg: GenerationConfig,
) -> dict[str, Any]:
    """The precision the study ran at, and which one its stored strategy (and plain decoding)
    would be fastest at on this machine (``autotune.tuning.precisions``)."""
    from autotune.tuning.precisions import advice, estimate, runnable, untimed

    speculative = report.chosen.speculates
    stats = report.verdict.chosen.stats
    context = sum(len(p) for p in prompts) // max(len(prompts), 1) + cfg.max_new_tokens // 2
    candidates = runnable(pool.device)
    skipped = untimed(target, candidates)  # the memory read once: what is timed and what is said agree
    estimates = estimate(pool, target, stats, setup.width if speculative else 1, context,
                         tuple(p for p in candidates if p not in skipped))
    return {"precision": target.precision, **advice(estimates, skipped)}


@dataclass
class _Setup:
    """What a study decodes and tunes with (``_build``)."""

    space: SearchSpace
    ctx: SpaceContext
    uniform: Strategy
    width: int  # the one verify width of the space
    uses_draft: str | None  # the draft model, when the space drafts with it
    decoder: Decoder  # plain decoding first, every drafter kind of the space on standby
    key: StrategyKey
    name: str
    study: optuna.Study
    tuner: OnlineTuner
    costs_kept: bool = False  # the cost model's timings came from the store (none were timed)


def _build(
    pool: ModelPool, target: LoadedModel, draft_name: str | None, task: str, prompts: list[list[int]],
    cfg: GenerationConfig, storage: Any, space_name: str, settings: TunerSettings, skip_ratio: float,
) -> _Setup:
    """The tuning decoder, the study (resumed when it exists) and the online tuner."""
    space = get_space(space_name)
    draft = default_draft(pool, draft_name) if draft_name else None
    ctx = space_context(space, target, draft, skip_ratio)
    uniform = uniform_strategy(space.name, ctx)
    width = verify_width(space, ctx)
    uses_draft = draft_name if "draft-model" in space.kinds(ctx) else None
    decoder = build_decoder(pool, target, PLAIN, uses_draft, verify_width=width, standby=standby_strategies(space, ctx))
    key = strategy_key(target, draft_name, task, pool.device)
    name = study_name(key, space.name)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name, storage=storage.optuna_storage(), direction="maximize", load_if_exists=True,
        sampler=optuna.samplers.RandomSampler(seed=settings.seed),
    )
    # a resumed study's best is tried first (it must win its race); a new one starts with the reference
    initial = _resume(study, space, ctx) or uniform
    drafting = decoder.drafter_of("draft-model") or decoder.drafter_of("layer-skip")
    mean_len = sum(len(p) for p in prompts) // max(len(prompts), 1)
    cost = MeasuredCostModel(draft=drafting.model if drafting is not None else decoder.target, target=decoder.target,
                             verify_width=width, context=mean_len + cfg.max_new_tokens // 2, repeats=1, warm=False,
                             padded=decoder.pads)
    kept = _keep_costs(storage, key, cost, fit_skips="layer-skip" in space.kinds(ctx))
    tuner = OnlineTuner(space, ctx, study, cost, settings, initial)
    tuner.state.calibration_s = cost.calibration_s  # timed before decoding (nothing when kept)
    return _Setup(space, ctx, uniform, width, uses_draft, decoder, key, name, study, tuner, kept)


def _keep_costs(storage: Any, key: StrategyKey, cost: MeasuredCostModel, fit_skips: bool) -> bool:
    """The cost model's timings from the store, else timed now, before decoding (the plain step,
    the verifies, the draft step and its catch-up; the per-sub-layer fit where the space skips
    layers): a one-time cost of the models on this machine, kept for the next study, never held
    against the tuning allowance. -> whether they came from the store."""
    import torch

    if cost.restore(storage.costs(key, cost.shape) or {}):
        return True
    with torch.inference_mode():
        cost.prepare(fit_skips=fit_skips)
    return False


def _tune(
    setup: _Setup, pool: ModelPool, target: LoadedModel, prompts: list[list[int]], cfg: GenerationConfig,
    progress: bool, baseline: bool,
) -> tuple[DecodeStats, Baseline | None, float]:
    """Decode ``prompts`` with the tuner between rounds (with ``baseline``, plainly too, next to
    it). -> (the tuning decoder's stats, the baseline, tuning time's share of the wall time)."""
    decoder, tuner = setup.decoder, setup.tuner
    stats = DecodeStats()
    plain_decoder = build_decoder(pool, target, PLAIN) if baseline else None
    base = Baseline(DecodeStats(), DecodeStats(), True) if baseline else None
    tune_wall = Stopwatch()
    with tqdm(total=len(prompts), desc=f"study {setup.space.name}", unit="prompt", disable=not progress) as bar:
        for i, ids in enumerate(prompts):
            # the baseline decodes before the tuning decoder on even prompts and after it on odd
            # ones, so an effect of going first or second (the machine's speed drifts) cancels
            plain_first = plain_decoder is not None and i % 2 == 0
            plain_run = plain_decoder.generate(ids, cfg) if plain_first else None
            with tune_wall:
                tuner.start_prompt(len(ids))
                result = decoder.generate(ids, cfg, before_round=tuner.before_round)
                tuner.end_prompt(ids + result.tokens, result.stats, flush=False)
            if plain_decoder is not None and not plain_first:
                plain_run = plain_decoder.generate(ids, cfg)
            stats = stats.merge(result.stats)
            if base is not None and plain_run is not None:
                base.plain, base.tuning = base.plain.merge(plain_run.stats), base.tuning.merge(result.stats)
                base.identical &= plain_run.tokens == result.tokens
            bar.update(1)
            bar.set_postfix_str(f"trials {tuner.state.trials} incumbent {tuner.state.best_score:.2f} tok/s")
    with Stopwatch() as flushing:
        tuner.flush()  # the trials to the RDB study, once (between prompts it was a third of the allowance)
    tuner.state.flush_s = flushing.seconds
    tuning_share = tuner.state.tuning_s / tune_wall.seconds if tune_wall.seconds else 0.0  # per window: one-time costs apart
    return stats, base, tuning_share


def _record(
    setup: _Setup, storage: Any, verdict: Verdict, stats: DecodeStats, base: Baseline | None, tuning_share: float,
    prompt_texts: Sequence[str], tuned_prompts: int,
) -> StudyReport:
    """Store the held-out judgement's winner with its held-out speed-up, and what ``autotune
    report`` draws on the study. -> the study's report."""
    tuner, study, name = setup.tuner, setup.study, setup.name
    summary = tuner.summary()
    summary["costs"] = "kept" if setup.costs_kept else "timed"  # the cost model's timings: from the store, or timed now
    summary["bayes_trials"] = sum(1 for t in tuner.study.get_trials(deepcopy=False)
                                  if t.user_attrs.get("sampler") == "bayes" and t.state.is_finished())
    chosen = verdict.chosen
    if base is not None and not base.identical:  # an output differed while tuning: nothing speculative
        chosen = verdict.plain
        verdict = replace(verdict, chosen=chosen, reason=(
            "plain decoding: the tuning decoder's output differed from plain decoding, so nothing speculative "
            "was stored"))
    speculative = chosen.strategy.speculates
    plain_pred = summary["plain_predicted_tps"]
    task = chosen.predicted_tps if speculative else plain_pred  # from the prompts tuned on
    text = chosen.text_tps if speculative else plain_pred  # priced on the held-out prompts' own text
    decode = chosen.stats.decode_tokens_per_s  # the rounds the prediction is about (prefill left out)
    summary["stored"] = {"predicted_tps": text, "task_predicted_tps": task, "measured_tps": chosen.stats.tokens_per_s,
                         "decode_tps": decode, "ratio": text / decode if text and decode else None,
                         "task_ratio": task / decode if task and decode else None,
                         "on": "in-sample prompt" if verdict.in_sample else "held-out prompts"}
    predicted = text or task
    heldout = verdict.as_dict()
    for attr, value in (("kept", summary["kept"]), ("switches", summary["switches"]), ("stored", summary["stored"]),
                        ("rejected", summary["rejected"]), ("tune_stats", stats.as_dict()),
                        ("plain_predicted_tps", summary["plain_predicted_tps"]), ("tuning_share", tuning_share),
                        ("heldout", heldout)):
        study.set_user_attr(attr, value)  # what `autotune report` draws
    report = StudyReport(
        name=name, space=setup.space.name, best=tuner.best, chosen=chosen.strategy, uniform=setup.uniform,
        tuner=summary, tune_stats=stats, verdict=verdict, tuning_share=tuning_share,
        storage_url=storage.display_url, tuned_prompts=tuned_prompts, baseline=base,
    )
    plain_tps = verdict.plain.stats.tokens_per_s
    report.history_id = storage.record(setup.key, chosen.strategy, ResultMetrics(
        score=chosen.stats.tokens_per_s, measured_tps=chosen.stats.tokens_per_s,
        predicted_tps=predicted or None,
        acceptance=chosen.stats.acceptance_rate if chosen.stats.drafted else None,
        speedup=chosen.stats.tokens_per_s / plain_tps if plain_tps else None,
        tuning_share=tuning_share, study_name=name,
    ), prompts=prompt_texts)
    return report


def _resume(study: optuna.Study, space: SearchSpace, ctx: SpaceContext) -> Strategy | None:
    """The best strategy of an existing study (``load_if_exists``), so tuning goes on from it."""
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        return None
    best = max(done, key=lambda t: t.value if t.value is not None else float("-inf"))
    return space.define(optuna.trial.FixedTrial(best.params), ctx)


def _judge(pool: ModelPool, target: LoadedModel, setup: _Setup, prompts: list[list[int]], cfg: GenerationConfig,
           in_sample: bool) -> Verdict:
    """Plain decoding, the tuner's incumbent and its runner-up on ``prompts`` (held out of tuning),
    interleaved after a warm-up; the choice is ``heldout.choose``'s."""
    tuner = setup.tuner
    plain = plain_candidate()
    others = []
    if tuner.best.speculates:
        others.append(Candidate(tuner.best, "incumbent", tuner.task_tps(tuner.best)))
    for strategy, score in runner_ups(tuner, setup.space, setup.ctx):
        # predicted over the whole task where that is free, else on the window it was scored on
        others.append(Candidate(strategy, f"runner-up ({strategy.drafter})", tuner.task_tps(strategy) or score))
    # each at its own verify width: what `generate`, `bench` and `serve` build for a stored strategy
    decoders = {c.strategy: build_decoder(pool, target, c.strategy,
                                          setup.uses_draft if c.strategy.drafter == "draft-model" else None)
                for c in (plain, *others)}
    warm = GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens), eos_token_ids=cfg.eos_token_ids)
    for decoder in decoders.values():
        decoder.generate(prompts[0], warm)

    by_strategy = {c.strategy: c for c in others}

    def decode(strategy: Strategy, ids: list[int]) -> tuple[list[int], DecodeStats]:
        result = decoders[strategy].generate(ids, cfg)
        if strategy in by_strategy:  # priced on the text it just decoded (not timed: after its run)
            priced = price_text(tuner, decoders[strategy], strategy, ids + result.tokens, len(result.tokens))
            if priced is not None:
                by_strategy[strategy].priced.append(priced)
        return result.tokens, result.stats

    judge_on(prompts, [plain, *others], decode)
    return choose(plain, others, in_sample=in_sample)
