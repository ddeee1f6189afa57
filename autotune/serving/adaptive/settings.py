"""Settings of adaptive serving (``autotune serve --adaptive``; see ``autotune.serving.adaptive.adaptive``).

Kept apart from the machinery so the CLI reads the defaults without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import SettingError


PENDING_TEXTS = 64
"""Unknown requests a pending cluster remembers (the first ones become a new route's prompts)."""
PENDING_CLUSTERS = 8
"""Pending clusters of unknown traffic kept at once; opening one more drops the stalest (and its re-tune)."""


@dataclass(frozen=True)
class AdaptSettings:
    """``autotune serve --adaptive`` settings (see the module docstring)."""

    ewma: float = 0.3  # weight of a route's newest request in its running acceptance and tokens/s
    min_requests: int = 3  # requests a route serves with its strategy before it is judged
    # re-tune below (1 - this) x the stored acceptance: measured by drift_eval on the Qwen pair
    # (the smallest drop with no false alarm; docs/benchmarks.md)
    acceptance_drop: float = 0.25
    # ... and at least this far below it (a relative drop of a near-zero acceptance is noise)
    acceptance_floor_drop: float = 0.1
    slower_margin: float = 0.05  # fall back to plain below (1 - this) x plain decoding's tokens/s
    retune_requests: int = 4  # requests a re-tune decodes with the online tuner
    retune_share: float = 0.05  # at most this share of a re-tune's decode time goes to tuning
    new_route_requests: int = 6  # unknown requests (of one pending cluster) that become a new route
    recheck_plain_requests: int = 32  # requests a route stored as plain serves before it re-checks speculation
    max_routes: int = 32  # routes created from unknown traffic (``auto:...``) in the store, at most
    max_clusters: int = PENDING_CLUSTERS
    store_prompts: bool = False  # store re-tuned requests' text (else their hashed terms: ``routing.terms``)
    # a speculative re-tune result is stored only when its greedy output equals plain decoding's on
    # up to ``check_requests`` of the requests it tuned on, ``check_tokens`` tokens each
    check_requests: int = 2
    check_tokens: int = 32
    space: str = "auto"

    def __post_init__(self) -> None:
        for name in ("min_requests", "retune_requests", "new_route_requests", "recheck_plain_requests",
                     "max_routes", "max_clusters", "check_requests", "check_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SettingError(f"adaptive setting {name}={value!r} must be a positive integer")
        if self.new_route_requests > PENDING_TEXTS:
            raise SettingError(f"adaptive setting new_route_requests={self.new_route_requests} must be at most "
                               f"{PENDING_TEXTS} (the requests a pending cluster of unknown traffic keeps)")
        for name, lo, hi in (("ewma", 0.0, 1.0), ("acceptance_drop", 0.0, 1.0), ("slower_margin", 0.0, 1.0),
                             ("retune_share", 0.0, 1.0), ("acceptance_floor_drop", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value <= hi:
                raise SettingError(f"adaptive setting {name}={value!r} must be in ({lo:g}, {hi:g}]")
