"""How far a route's acceptance must fall before the server re-tunes it: the measurement behind
``AdaptSettings.acceptance_drop``.

For every task A: one strategy decodes A's first ``stored`` prompts (the acceptance a study would
store for A), then ``follow`` more of A's prompts (in-distribution traffic: re-tuning there is a
false alarm), and ``follow`` prompts of every other task B (shifted traffic: it should be caught
early). Each request's drafted / accepted counts go through the server's own rule (``judge`` on a
``RouteHealth``, acceptance only) for every drop on a grid. The default is the smallest drop with
no false alarm on any in-distribution sequence; the table shows when the shifted sequences are
caught at each drop.

    python -m autotune.serving.adaptive.drift_eval --model smollm2-135m
    python -m autotune.serving.adaptive.drift_eval --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.serving.adaptive.adaptive import RouteHealth, judge
from autotune.serving.adaptive.settings import AdaptSettings
from runtime.stats import DecodeStats
from search_spaces.strategy import Strategy

MEASURED_TASKS = ("humaneval", "gsm8k", "mt-bench")
GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))


@dataclass(frozen=True)
class Requests:
    """Per request of one task decoded with one strategy: (drafted, accepted)."""

    task: str
    counts: tuple[tuple[int, int], ...]

    def acceptance(self) -> float:
        drafted = sum(d for d, _ in self.counts)
        return sum(a for _, a in self.counts) / drafted if drafted else 0.0


def caught_at(stored: float, counts: Sequence[tuple[int, int]], drop: float, settings: AdaptSettings) -> int | None:
    """The 1-based request after which the rule re-tunes a route stored with acceptance ``stored``
    that receives ``counts``; None when it never does."""
    health = RouteHealth("eval", Strategy(drafter="prompt-lookup"), "eval", stored_acceptance=stored)
    rule = AdaptSettings(ewma=settings.ewma, min_requests=settings.min_requests, acceptance_drop=drop,
                         acceptance_floor_drop=settings.acceptance_floor_drop)
    for i, (drafted, accepted) in enumerate(counts, 1):
        health.observe(DecodeStats(new_tokens=1, drafted=drafted, accepted=accepted), rule.ewma)
        if judge(health, None, rule) is not None:
            return i
    return None


@dataclass(frozen=True)
class DriftMeasurement:
    stored: dict[str, Requests]  # task -> its first prompts (the stored figure)
    follow: dict[str, Requests]  # task -> its next prompts
    settings: AdaptSettings

    def false_alarms(self, drop: float) -> list[str]:
        return [t for t, r in self.follow.items()
                if caught_at(self.stored[t].acceptance(), r.counts, drop, self.settings) is not None]

    def delays(self, drop: float) -> dict[tuple[str, str], int | None]:
        """(stored task, traffic task) -> the request after which the shift was caught."""
        return {(a, b): caught_at(self.stored[a].acceptance(), self.follow[b].counts, drop, self.settings)
                for a in self.stored for b in self.follow if a != b}

    def default_drop(self) -> float:
        """The smallest drop with no false alarm (the most sensitive safe setting)."""
        return next((d for d in GRID if not self.false_alarms(d)), GRID[-1])

    def table(self) -> str:
        pick = self.default_drop()
        lines = ["| stored on | acceptance stored / next prompts | traffic | its acceptance | caught after request "
                 f"(drop {pick:.2f}) |", "|---|---|---|---|---|"]
        for (a, b), at in self.delays(pick).items():
            lines.append(f"| {a} | {self.stored[a].acceptance():.2f} / {self.follow[a].acceptance():.2f} | {b} | "
                         f"{self.follow[b].acceptance():.2f} | {at if at is not None else 'never'} |")
        caught = {d: sum(x is not None for x in self.delays(d).values()) for d in GRID}
        curve = ", ".join(f"{d:.2f}: {len(self.false_alarms(d))} false / {caught[d]} caught" for d in GRID[::2])
        lines.append(f"\ndefault drop {pick:.2f} (smallest with no false alarm); by drop: {curve}")
        return "\n".join(lines)


def measure_drift(model: str, draft: str | None, strategy: Strategy, tasks: Sequence[str] = MEASURED_TASKS,
                  stored: int = 4, follow: int = 6, max_tokens: int = 64,
                  settings: AdaptSettings = AdaptSettings()) -> DriftMeasurement:
    """Decode the tasks' prompts as chat requests (the server's form) with ``strategy``."""
    from runtime.decoding import GenerationConfig
    from runtime.pipeline import ModelPool, build_decoder, eos_ids
    from studies import Prompt, encode_prompt, load_prompts, routing_text

    pool = ModelPool()
    target = pool.get(model, "float32")
    decoder = build_decoder(pool, target, strategy, draft if strategy.drafter == "draft-model" else None)
    cfg = GenerationConfig(max_new_tokens=max_tokens, eos_token_ids=eos_ids(target))

    def run(task: str, n: int, offset: int) -> Requests:
        counts = []
        for p in load_prompts(task, None, n, offset):
            ids = encode_prompt(Prompt(id=p.id, messages=(("user", routing_text(p)),)), target.tokenizer)
            s = decoder.generate(ids, cfg).stats
            counts.append((s.drafted, s.accepted))
        return Requests(task, tuple(counts))

    return DriftMeasurement({t: run(t, stored, 0) for t in tasks}, {t: run(t, follow, stored) for t in tasks}, settings)


def main() -> None:
    ap = argparse.ArgumentParser(description="measure the acceptance drop that signals drift")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft")
    ap.add_argument("--stored", type=int, default=4)
    ap.add_argument("--follow", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    strategy = Strategy(draft_length=10) if args.draft else Strategy(drafter="prompt-lookup", draft_length=6)
    print(measure_drift(args.model, args.draft, strategy, stored=args.stored, follow=args.follow,
                        max_tokens=args.max_tokens).table())


if __name__ == "__main__":
    main()
