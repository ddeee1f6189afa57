"""Drafter kinds: one ``DrafterKind`` entry per kind in ``KINDS``, keyed by the name strategies store.

Contract: the registry lives here, in ``search_spaces``, which every layer may import. An entry
holds what strategies and search spaces need (its traits); the layers above attach their parts to
it by name: ``runtime.pipeline`` its drafter factory (``build``), ``autotune.tuning.scoring`` its
scorer, which prices a candidate with the cost model (``score``). ``register`` adds a kind with
any parts in one call; each part is attached once, and asking for one never attached is an error.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from search_spaces.errors import StrategyError

# the built-in kinds' names (what stored strategies and the CLI say)
NONE, DRAFT_MODEL, LAYER_SKIP, PROMPT_LOOKUP = "none", "draft-model", "layer-skip", "prompt-lookup"

# how a kind's strategies use ``Strategy.layer_plan``: never, optionally (a draft model's own plan),
# or always, skipping at least one sub-layer (the target drafting for itself)
PLAN_USES = ("never", "optional", "skips")
PARTS = ("build", "score")  # what the layers above attach (see the module docstring)


@dataclass(frozen=True)
class DrafterKind:
    """A drafter kind's traits. ``speculates``: it drafts at all (``none`` does not).
    ``model_drafts``: it drafts from a model's distribution, so a confidence threshold and tree
    shapes apply and each drafted depth costs a draft forward. ``copies_first``: its rounds may try
    prompt lookup first (``Strategy.lookup_first``). ``parts``: attached by the layers above."""

    name: str
    layer_plan: str = "never"
    speculates: bool = True
    model_drafts: bool = False
    copies_first: bool = False
    parts: dict[str, Callable[..., Any]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise StrategyError(f"a drafter kind needs a non-empty name without surrounding spaces, got {self.name!r}")
        if self.layer_plan not in PLAN_USES:
            raise StrategyError(f"layer_plan={self.layer_plan!r} must be one of {', '.join(PLAN_USES)}")
        for name in ("speculates", "model_drafts", "copies_first"):
            if not isinstance(getattr(self, name), bool):
                raise StrategyError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.copies_first and not self.model_drafts:
            raise StrategyError(f"kind {self.name!r}: only a kind drafting with a model checks lookup copies first")

    def part(self, role: str) -> Callable[..., Any]:
        """The ``role`` part the layers above attached (``PARTS``); an error naming it if none was."""
        try:
            return self.parts[role]
        except KeyError:
            raise StrategyError(f"drafter kind '{self.name}' has no '{role}' part attached") from None


KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind, **parts: Callable[..., Any]) -> DrafterKind:
    """Add ``kind`` (a new name) with ``parts`` attached: how a kind joins every layer in one call."""
    if kind.name in KINDS:
        raise StrategyError(f"drafter kind '{kind.name}' is registered already")
    KINDS[kind.name] = kind
    attach(kind.name, **parts)
    return kind


def attach(name: str, **parts: Callable[..., Any]) -> None:
    """Attach ``parts`` (role -> callable, roles from ``PARTS``) to the registered kind ``name``."""
    kind = kind_of(name)
    for role, part in parts.items():
        if role not in PARTS:
            raise StrategyError(f"unknown part '{role}' for drafter kind '{name}'; parts: {', '.join(PARTS)}")
        if role in kind.parts:
            raise StrategyError(f"drafter kind '{name}' has a '{role}' part attached already")
        if not callable(part):
            raise StrategyError(f"the '{role}' part of drafter kind '{name}' must be callable, got {part!r}")
        kind.parts[role] = part


def unregister(name: str) -> None:
    """Remove the kind ``name`` (a kind a test registered); the built-in kinds stay."""
    if name in BUILT_IN:
        raise StrategyError(f"drafter kind '{name}' is built in and cannot be removed")
    del KINDS[kind_of(name).name]


def kind_of(name: str) -> DrafterKind:
    """The registered kind ``name``; ``StrategyError`` naming the known kinds otherwise."""
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise StrategyError(f"drafter={name!r} is not allowed; choose one of {', '.join(KINDS)}")
    return kind


def kind_names() -> tuple[str, ...]:
    return tuple(KINDS)


def kinds_with(predicate: Callable[[DrafterKind], bool]) -> Iterator[DrafterKind]:
    return (k for k in KINDS.values() if predicate(k))


for _kind in (
    DrafterKind(NONE, speculates=False),
    DrafterKind(DRAFT_MODEL, layer_plan="optional", model_drafts=True, copies_first=True),
    DrafterKind(LAYER_SKIP, layer_plan="skips", model_drafts=True),
    DrafterKind(PROMPT_LOOKUP),
):
    register(_kind)
BUILT_IN = (NONE, DRAFT_MODEL, LAYER_SKIP, PROMPT_LOOKUP)
