"""Statistics every decode returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeStats:
    """Counters filled by the decode loop; derived rates are properties."""

    new_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards after the prefill
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0  # including the prefill
    prefix_rows: int = 0  # the prompt's leading rows a prefix cache gave (not prefilled)
    draft_rounds: int = 0  # verify passes that checked at least one draft token
    accept_hist: list[int] = field(default_factory=list)  # rounds by number of drafts accepted
    position_drafted: list[int] = field(default_factory=list)  # per draft position i
    position_accepted: list[int] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)  # rounds by the rows they verified (1 + drafted), unpadded

    def record_rows(self, rows: int) -> None:
        """One round's target forward verified ``rows`` rows (its token and its drafts; before padding)."""
        _bump(self.verify_rows, rows)

    def record_round(self, n_drafted: int, n_accepted: int, depth: int | None = None) -> None:
        """One verify of ``n_drafted`` nodes (a chain, or a tree of ``depth`` levels)."""
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.draft_rounds += 1
        _bump(self.accept_hist, n_accepted)
        for i in range(n_drafted if depth is None else depth):
            _bump(self.position_drafted, i)
            if i < n_accepted:
                _bump(self.position_accepted, i)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens/s of the decode rounds (the prefill's time left out): what a tuner's cost model predicts."""
        rounds = self.wall_s - self.prefill_s
        return self.new_tokens / rounds if rounds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """M: new tokens per target forward, bonus token included."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Draft tokens (tree nodes) checked per verify pass."""
        return self.drafted / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def draft_ms_per_100(self) -> float:
        return 1e5 * self.draft_s / self.new_tokens if self.new_tokens else 0.0

    @property
    def verify_ms_per_100(self) -> float:
        return 1e5 * self.verify_s / self.new_tokens if self.new_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted": self.mean_accepted,
            "draft_ms_per_100": self.draft_ms_per_100,
            "verify_ms_per_100": self.verify_ms_per_100,
            "mean_tree_size": self.mean_tree_size,
            "prefill_s": self.prefill_s,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "target_forwards": self.target_forwards,
            "accept_hist": list(self.accept_hist),
            "position_acceptance": [
                a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)
            ],
        }

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        out = DecodeStats()
        for name in ("new_tokens", "wall_s", "prefill_s", "draft_s", "verify_s", "drafted",
                     "accepted", "target_forwards", "draft_rounds"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("accept_hist", "position_drafted", "position_accepted", "verify_rows"):
            a, b = getattr(self, name), getattr(other, name)
            n = max(len(a), len(b))
            setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
        return out


def _bump(hist: list[int], i: int) -> None:
    while len(hist) <= i:
        hist.append(0)
    hist[i] += 1
