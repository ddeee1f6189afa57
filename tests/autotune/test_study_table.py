"""The study's printout (no model loads): its first line says what was stored, in words, with its
held-out speed-up and how far that figure goes; the incumbent, runner-ups, matchness and the
tuning costs (per window apart from one-time) follow in the table."""
from __future__ import annotations

import pytest

from autotune.reports.study_table import format_study, headline, strategy_in_words
from autotune.tuning.heldout import Candidate, Verdict
from autotune.tuning.study import StudyReport
from runtime.stats import DecodeStats
from search_spaces.layer_plan import uniform_skip_plan
from search_spaces.strategy import PLAIN, Strategy

LOOKUP = Strategy(drafter="prompt-lookup", draft_length=12)
TUNER = {"trials": 40, "stop_reason": "allowance spent", "best_matchness": 0.0, "best_predicted_tps": 9.5,
         "plain_predicted_tps": 10.0, "bayes_trials": 12, "measured_trials": 3, "swept": 64, "windows": 20,
         "calibration_s": 4.0, "costs": "timed", "stored": {}}


def _runs(tps: list[float]) -> list[DecodeStats]:
    return [DecodeStats(new_tokens=100, wall_s=100 / x) for x in tps]


def report(chosen: Strategy = LOOKUP, ups: tuple[float, ...] = (3.41,), in_sample: bool = False,
           best: Strategy = PLAIN) -> StudyReport:
    """A study whose held-out prompts ran plain decoding at 10 tok/s and ``chosen`` ``ups`` times faster."""
    plain = Candidate(PLAIN, "plain", runs=_runs([10.0] * len(ups)))
    candidates = [plain]
    if chosen.speculates:
        candidates.append(Candidate(chosen, "runner-up", runs=_runs([10.0 * u for u in ups])))
    picked = candidates[-1]
    verdict = Verdict(picked, f"the {picked.label}", tuple(candidates), in_sample)
    return StudyReport(name="m|humaneval|auto|cpu", space="auto", best=best, chosen=chosen, uniform=PLAIN,
                       tuner=dict(TUNER), tune_stats=DecodeStats(new_tokens=960, wall_s=80.0), verdict=verdict,
                       tuning_share=0.015, storage_url="sqlite:///x.db", tuned_prompts=2, history_id=7)


def test_the_first_line_names_the_stored_strategy_in_words() -> None:
    first = format_study(report()).splitlines()[0]
    assert first == "stored: prompt lookup, up to 12 tokens: 3.41x plain on 1 held-out prompt (a weak check: " \
                    "--limit 10 holds out 3)"


def test_the_headline_carries_the_interval_or_says_the_figure_is_in_sample() -> None:
    three = headline(report(ups=(3.0, 3.5, 4.0)))
    assert three.startswith("stored: prompt lookup, up to 12 tokens: 3.45x plain on 3 held-out prompts, 95% interval ")
    assert "weak" not in three
    assert "in-sample" in headline(report(in_sample=True))
    assert headline(report(chosen=PLAIN, ups=(1.0, 1.0, 1.0))) == (
        "stored: plain decoding: no candidate was reliably faster on 3 held-out prompts")


def table_rows(text: str) -> dict[str, str]:
    """The table's rows in order: field -> its value, a value folded over several lines joined."""
    rows: dict[str, str] = {}
    field = ""
    for line in text.splitlines():
        cells = line.split("│")
        if len(cells) == 4:
            field = cells[1].strip() or field
            rows[field] = f"{rows.get(field, '')} {cells[2].strip()}".strip()
    return rows


def test_the_table_follows_the_headline_incumbent_and_costs_apart() -> None:
    text = format_study(report())
    assert text.splitlines()[1].strip() == "study m|humaneval|auto|cpu"
    rows = table_rows(text)
    assert list(rows)[:6] == ["stored", "held-out speedup", "incumbent", "candidates", "matchness", "predicted tok/s"]
    assert rows["stored"].startswith("prompt-lookup k=12 in sqlite:///x.db (history row 7)")
    assert rows["incumbent"].startswith('{"calibrate"') and "tuned on" in rows["incumbent"]
    assert rows["matchness"] == "0.000 (the incumbent is plain decoding: it drafts nothing to match)"
    assert rows["tuning share"].startswith("1.5% of decode time while tuning, spent window by window")
    assert rows["one-time"] == ("4.0 s timing the cost model (kept in the store for the next study; 5.0% of the "
                                "80.0 s decoded)")
    assert "best strategy" not in rows


@pytest.mark.parametrize("strategy, words", [
    (PLAIN, "plain decoding"),
    (LOOKUP, "prompt lookup, up to 12 tokens"),
    (Strategy(draft_length=5, confidence_threshold=0.0), "the draft model, up to 5 tokens"),
    (Strategy(draft_length=5, tree_widths=(4, 2, 1, 1, 1), lookup_first=True),
     "the draft model, up to 5 tokens, a token tree 4x2x1x1x1, stopping below 0.6 confidence, prompt lookup first"),
    (Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(12, 0.45)),
     "the target skipping layers, up to 4 tokens, stopping below 0.6 confidence"),
])
def test_strategies_in_words(strategy: Strategy, words: str) -> None:
    assert strategy_in_words(strategy) == words
