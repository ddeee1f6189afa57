"""The Strategy value: how to speculate. Frozen, validated, JSON round-trip with a schema version.

The tuner issue grows this (layer plans, trees, thresholds); fields added later get defaults so
older JSON keeps loading.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from search_spaces.errors import StrategyError
from search_spaces.kinds import DRAFT_MODEL, NONE, kind_of, kinds_with
from search_spaces.layer_plan import SKIP_RATIO, LayerPlan

SCHEMA_VERSION = 1

DRAFT_PRECISIONS = ("auto", "float32", "bfloat16", "int8", "int4", "w8a8", "gguf")
MAX_DRAFT_LENGTH = 64
MAX_TREE_NODES = 256
LOOKUP_FIRST_MIN_NGRAM = 3  # `lookup_first` copies only after a match of this many tokens (short ones copy noise)
# the tree `autotune bench --methods sd-tree` uses when none is given (measured on CPU, see docs)
DEFAULT_TREE_WIDTHS: tuple[int, ...] = (2, 1, 1, 1, 1, 1, 1, 1, 1, 1)
# SWIFT 4.2 dynamic verification: top-1 probability in (0,0.5] -> 10 candidates, ... (0.95,1] -> 1
SWIFT_DYNAMIC_WIDTHS: tuple[tuple[float, int], ...] = ((0.5, 10), (0.8, 5), (0.95, 3), (1.0, 1))


@dataclass(frozen=True)
class Strategy:
    """How to decode.

    - ``drafter``: a registered kind (``search_spaces.kinds``): ``none`` (plain decoding), ``draft-model`` (a smaller model of the family),
      ``layer-skip`` (the target itself with ``layer_plan`` skipping layers: SWIFT
      self-speculation) or ``prompt-lookup`` (copy the continuation of the latest matching n-gram
      of the context).
    - ``layer_plan``: how the drafting model runs its layers (see ``search_spaces.layer_plan``):
      layer-parallel groups (EasySpec fuzzy drafting) and skipped sub-layers. ``None`` = all
      layers in order. Required for ``layer-skip``; not allowed for ``prompt-lookup``/``none``.
    - ``calibrate``: EasySpec bonus calibration for a draft model with layer-parallel groups:
      after each verification the draft's fuzzy KV rows are discarded and accepted + bonus tokens
      re-run exactly in one forward. Off only for ablations.
    - ``draft_length``: tokens drafted per round (gamma).
    - ``draft_precision``: arithmetic of the draft (``runtime.precision``; ``auto`` = the fastest draft step measured on the device kind). Only
      the target must be exact, so a low-precision draft stays lossless: the target verifies
      every token.
    - ``confidence_threshold``: stop a draft chain early once the draft's top-1 probability
      falls below this (SWIFT's confidence-aware drafting); 0 disables.
    - ``tree_widths``: draft a token tree instead of a chain: children per node at each depth
      (e.g. ``(4, 2, 2, 1, 1)``); its length must equal ``draft_length``. ``None`` = a chain.
    - ``dynamic_widths``: SWIFT's dynamic verification table ``((p_max, k), ...)``, ascending
      ``p_max`` ending at 1.0: each draft position also offers its top-k candidates, k chosen by
      the draft's confidence (see ``SWIFT_DYNAMIC_WIDTHS``). Exclusive with ``tree_widths``.
    - ``lookup_first``: a draft model's rounds first try prompt lookup (an n-gram of at least
      ``LOOKUP_FIRST_MIN_NGRAM`` tokens of the context recurs). Where it matches, a chain's draft
      checks the copied continuation in its catch-up forward, keeps each copied token it would
      have drafted itself (greedy: the same draft as without lookup) and drafts on from the
      first it would not: fewer sequential draft forwards where the text repeats. A tree's round
      takes the copy alone (the model drafts nothing). Elsewhere the model drafts.
    - ``draft_vocab``: restrict the draft's output head to token ids ``[0, draft_vocab)`` (BPE ids
      are roughly frequency-ordered); ``None`` keeps the full head. Lossless either way, but
      measured on HumanEval with the Qwen pair, 32768 ids cost more acceptance (alpha 0.70 vs
      0.98: identifiers often have large ids) than the smaller head saves, hence full by default.
    """

    drafter: str = DRAFT_MODEL
    draft_length: int = 10
    draft_precision: str = "auto"
    draft_vocab: int | None = None
    confidence_threshold: float = 0.6
    tree_widths: tuple[int, ...] | None = None
    dynamic_widths: tuple[tuple[float, int], ...] | None = None
    layer_plan: LayerPlan | None = None
    calibrate: bool = True
    lookup_first: bool = False
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        kind_of(self.drafter)  # a registered kind (search_spaces.kinds)
        _check_choice("draft_precision", self.draft_precision, DRAFT_PRECISIONS)
        _check_int("draft_length", self.draft_length, 1, MAX_DRAFT_LENGTH)
        if self.draft_vocab is not None:
            _check_int("draft_vocab", self.draft_vocab, 1, 10**7)
        _check_float("confidence_threshold", self.confidence_threshold, 0.0, 1.0)
        self._check_tree()
        self._check_plan()
        if self.schema_version != SCHEMA_VERSION:
            raise StrategyError(
                f"schema_version={self.schema_version!r} is not supported (this build reads {SCHEMA_VERSION})"
            )

    def _check_tree(self) -> None:
        if self.tree_widths is not None:
            widths = self.tree_widths
            if not isinstance(widths, tuple) or not widths:
                raise StrategyError(f"tree_widths={widths!r} must be a non-empty list of integers")
            for w in widths:
                _check_int("tree_widths", w, 1, 16)
            if len(widths) != self.draft_length:
                raise StrategyError(
                    f"tree_widths={list(widths)} has {len(widths)} depths but draft_length={self.draft_length}; "
                    "make them equal"
                )
            if self.max_tree_nodes > MAX_TREE_NODES:
                raise StrategyError(
                    f"tree_widths={list(widths)} gives {self.max_tree_nodes} nodes; at most {MAX_TREE_NODES} allowed"
                )
        if self.dynamic_widths is not None:
            if self.tree_widths is not None:
                raise StrategyError("tree_widths and dynamic_widths are exclusive; set one of them")
            _check_table(self.dynamic_widths)

    def _check_plan(self) -> None:
        if not isinstance(self.calibrate, bool):
            raise StrategyError(f"calibrate={self.calibrate!r} must be true or false")
        if not isinstance(self.lookup_first, bool):
            raise StrategyError(f"lookup_first={self.lookup_first!r} must be true or false")
        kind = kind_of(self.drafter)
        if self.lookup_first and not kind.copies_first:
            users = " and ".join(k.name for k in kinds_with(lambda k: k.copies_first))
            raise StrategyError(f"lookup_first is only used by drafter {users}, not '{self.drafter}'")
        plan = self.layer_plan
        if plan is not None and not isinstance(plan, LayerPlan):
            raise StrategyError(f"layer_plan={plan!r} must be a layer plan object")
        if kind.layer_plan == "skips":
            if plan is None or not (plan.skip_attn or plan.skip_mlp):
                raise StrategyError(
                    f"layer_plan: drafter '{self.drafter}' needs a plan that skips at least one sub-layer "
                    f"(e.g. --skip-ratio {SKIP_RATIO})"
                )
        elif plan is not None and kind.layer_plan == "never":
            users = " and ".join(k.name for k in kinds_with(lambda k: k.layer_plan != "never"))
            raise StrategyError(f"layer_plan is only used by drafters {users}, not '{self.drafter}'")

    @property
    def max_tree_nodes(self) -> int:
        """Upper bound on draft tokens per verify pass."""
        return tree_node_bound(self.tree_widths or (1,) * self.draft_length, self.dynamic_widths)

    @property
    def speculates(self) -> bool:
        return kind_of(self.drafter).speculates

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_plan"] = None if self.layer_plan is None else self.layer_plan.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Strategy":
        if not isinstance(data, dict):
            raise StrategyError(f"a strategy must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StrategyError(f"unknown strategy field(s) {unknown}; known: {sorted(known)}")
        data = dict(data)
        if isinstance(data.get("tree_widths"), list):
            data["tree_widths"] = tuple(data["tree_widths"])
        if isinstance(data.get("dynamic_widths"), list):
            data["dynamic_widths"] = tuple(tuple(row) if isinstance(row, list) else row for row in data["dynamic_widths"])
        if data.get("layer_plan") is not None:
            data["layer_plan"] = LayerPlan.from_dict(data["layer_plan"])
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StrategyError(f"strategy is not valid JSON: {exc}") from exc
        return cls.from_dict(data)



def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise StrategyError(f"{name}={value!r} is not allowed; choose one of {', '.join(allowed)}")


def tree_node_bound(widths: tuple[int, ...], dynamic: tuple[tuple[float, int], ...] | None) -> int:
    """Most nodes a tree can have: full expansion of ``widths``, or with a dynamic-widths table a
    chain of ``len(widths)`` positions each offering the table's largest k."""
    if dynamic is not None:
        return len(widths) * max(k for _, k in dynamic)
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


def _check_table(table: Any) -> None:
    bad = StrategyError(
        f"dynamic_widths={table!r} must be ((p_max, k), ...) with ascending p_max in (0, 1] ending at 1.0 "
        "and integer k in 1..16"
    )
    if not isinstance(table, tuple) or not table:
        raise bad
    last = 0.0
    for row in table:
        if not isinstance(row, tuple) or len(row) != 2:
            raise bad
        p_max, k = row
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise bad
        if isinstance(p_max, bool) or not isinstance(p_max, (int, float)) or not last < p_max <= 1.0:
            raise bad
        last = float(p_max)
    if last != 1.0:
        raise bad


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise StrategyError(f"{name}={value!r} is out of range; allowed numbers {lo}..{hi}")


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise StrategyError(f"{name}={value!r} is out of range; allowed integers {lo}..{hi}")


PLAIN = Strategy(drafter=NONE)  # plain decoding: a point of every search space
