"""Layer plans: how a model used as a drafter executes its layers.

A plan names, for a model with ``n_layers`` layers,

- ``groups``: runs of consecutive layers ``(first, last)`` executed layer-parallel ("fuzzy",
  EasySpec algorithm 2): every attention sub-layer of the group reads the group's input hidden
  state; residual adds and MLPs then run in order;
- ``skip_attn`` / ``skip_mlp``: sub-layers not executed at all (SWIFT layer skipping).

Plans are frozen values validated on construction; errors name the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from search_spaces.errors import StrategyError

SKIP_RATIO = 0.45  # SWIFT's share of sub-layers a layer-skip draft skips, where none is given


@dataclass(frozen=True)
class LayerPlan:
    n_layers: int
    groups: tuple[tuple[int, int], ...] = ()
    skip_attn: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    # EasySpec found the embedding output a poor stand-in for deeper inputs: layer 0 stays alone
    allow_layer0_in_group: bool = False

    def __post_init__(self) -> None:
        n = self.n_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise StrategyError(f"layer_plan.n_layers={n!r} must be a positive integer")
        self._check_groups()
        for name in ("skip_attn", "skip_mlp"):
            layers = getattr(self, name)
            if not isinstance(layers, tuple):
                raise StrategyError(f"layer_plan.{name}={layers!r} must be a list of layer indices")
            for li in layers:
                self._check_index(name, li)
            if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
                raise StrategyError(f"layer_plan.{name}={list(layers)} must be sorted without repeats")
        if len(self.skip_attn) == n and len(self.skip_mlp) == n:
            raise StrategyError(
                f"layer_plan skips every attention and MLP sub-layer of all {n} layers; keep at least one"
            )

    def _check_index(self, name: str, li: Any) -> None:
        if isinstance(li, bool) or not isinstance(li, int) or not 0 <= li < self.n_layers:
            raise StrategyError(
                f"layer_plan.{name}: layer index {li!r} is out of range; the model has layers 0..{self.n_layers - 1}"
            )

    def _check_groups(self) -> None:
        if not isinstance(self.groups, tuple):
            raise StrategyError(f"layer_plan.groups={self.groups!r} must be a list of [first, last] pairs")
        last_end = -1
        for g in self.groups:
            if not isinstance(g, tuple) or len(g) != 2:
                raise StrategyError(f"layer_plan.groups: {g!r} is not a [first, last] pair")
            first, last = g
            self._check_index("groups", first)
            self._check_index("groups", last)
            if last <= first:
                raise StrategyError(
                    f"layer_plan.groups: [{first}, {last}] must span at least two layers (first < last)"
                )
            if first <= last_end:
                raise StrategyError(
                    f"layer_plan.groups: [{first}, {last}] overlaps or precedes the group ending at layer "
                    f"{last_end}; list disjoint groups in ascending order"
                )
            if first == 0 and not self.allow_layer0_in_group:
                raise StrategyError(
                    f"layer_plan.groups: [{first}, {last}] contains layer 0, which must run alone "
                    "(set allow_layer0_in_group to override)"
                )
            last_end = last

    # ------------------------------------------------------------------ views
    @property
    def is_identity(self) -> bool:
        """Runs every layer normally, in order (the plain model)."""
        return not self.groups and not self.skip_attn and not self.skip_mlp

    @property
    def skip_ratio(self) -> float:
        return (len(self.skip_attn) + len(self.skip_mlp)) / (2 * self.n_layers)

    @property
    def max_group(self) -> int:
        return max((last - first + 1 for first, last in self.groups), default=1)

    def blocks(self) -> list[tuple[int, ...]]:
        """Layers in execution order, grouped: a tuple of one layer runs normally."""
        out: list[tuple[int, ...]] = []
        starts = {first: last for first, last in self.groups}
        li = 0
        while li < self.n_layers:
            last = starts.get(li, li)
            out.append(tuple(range(li, last + 1)))
            li = last + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_layers": self.n_layers,
            "groups": [list(g) for g in self.groups],
            "skip_attn": list(self.skip_attn),
            "skip_mlp": list(self.skip_mlp),
            "allow_layer0_in_group": self.allow_layer0_in_group,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "LayerPlan":
        if isinstance(data, LayerPlan):
            return data
        if not isinstance(data, dict):
            raise StrategyError(f"layer_plan must be an object, got {type(data).__name__}")
        known = {"n_layers", "groups", "skip_attn", "skip_mlp", "allow_layer0_in_group"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StrategyError(f"unknown layer_plan field(s) {unknown}; known: {sorted(known)}")
        d = dict(data)
        if "n_layers" not in d:
            raise StrategyError("layer_plan.n_layers is required")
        if isinstance(d.get("groups"), list):
            d["groups"] = tuple(tuple(g) if isinstance(g, list) else g for g in d["groups"])
        for name in ("skip_attn", "skip_mlp"):
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
        return cls(**d)


def easyspec_plan(n_layers: int, lp_size: int) -> LayerPlan:
    """EasySpec's default layer-parallel plan (appendix B, table 6).

    Layer 0 and the last layer run alone. The first group is layers ``1..min(N, 3)``, then
    groups of ``N`` follow, and the remainder before the last layer forms the final (shorter)
    group. This reproduces every row of table 6, e.g. Llama-3-8B (32 layers) N=4:
    ``0, 1-3, 4-7, ..., 24-27, 28-30, 31`` and Qwen (28 layers) N=4: ``0, 1-3, ..., 24-26, 27``.
    """
    if isinstance(lp_size, bool) or not isinstance(lp_size, int) or lp_size < 1:
        raise StrategyError(f"lp_size={lp_size!r} must be a positive integer")
    if lp_size == 1 or n_layers < 4:
        return LayerPlan(n_layers=n_layers)
    groups: list[tuple[int, int]] = []
    inner_last = n_layers - 2
    first = 1
    size = min(lp_size, 3)
    while first <= inner_last:
        last = min(first + size - 1, inner_last)
        if last > first:
            groups.append((first, last))
        first, size = last + 1, lp_size
    return LayerPlan(n_layers=n_layers, groups=tuple(groups))


def uniform_skip_plan(n_layers: int, ratio: float) -> LayerPlan:
    """SWIFT's uniform layer skipping at ``ratio``: ``round(ratio * n_layers)`` whole layers
    (attention and MLP), spread evenly over layers ``1..n_layers-2`` (first and last never
    skipped)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise StrategyError(f"skip ratio {ratio!r} must be a number in [0, 1)")
    inner = list(range(1, n_layers - 1))
    n_skip = min(len(inner), round(ratio * n_layers))
    if n_skip == 0:
        return LayerPlan(n_layers=n_layers)
    step = len(inner) / n_skip
    skip = tuple(sorted({inner[int(i * step + step / 2)] for i in range(n_skip)}))
    return LayerPlan(n_layers=n_layers, skip_attn=skip, skip_mlp=skip)
