"""What ``autotune study`` prints: one line saying what was stored and how far its figure goes, then
the table under it (where it was stored and why, the tuner's incumbent and runner-ups, matchness,
predictions, and what tuning cost: per window apart from the one-time timings)."""
from __future__ import annotations

import math
from typing import Any

from search_spaces.strategy import Strategy

# the drafter kinds in words (a kind not named here is shown by its name)
DRAFTER_WORDS = {"none": "plain decoding", "prompt-lookup": "prompt lookup", "draft-model": "the draft model",
                 "layer-skip": "the target skipping layers"}


def strategy_in_words(strategy: Strategy) -> str:
    """``prompt lookup, up to 12 tokens``: the drafter, its length and what else is set."""
    if not strategy.speculates:
        return DRAFTER_WORDS["none"]
    parts = [DRAFTER_WORDS.get(strategy.drafter, strategy.drafter), f"up to {strategy.draft_length} tokens"]
    if strategy.tree_widths:
        parts.append("a token tree " + "x".join(map(str, strategy.tree_widths)))
    if strategy.dynamic_widths:
        parts.append("dynamic verification widths")
    if strategy.drafter in ("draft-model", "layer-skip") and strategy.confidence_threshold:
        parts.append(f"stopping below {strategy.confidence_threshold:g} confidence")
    if strategy.drafter == "draft-model" and strategy.layer_plan is not None and not strategy.layer_plan.is_identity:
        parts.append("its layers planned (EasySpec)")
    if strategy.lookup_first:
        parts.append("prompt lookup first")
    return ", ".join(parts)


def headline(report: Any) -> str:
    """``stored: <strategy in words>: <speed-up> plain on <n> held-out prompt(s)``, with its interval
    where there is one and a warning where the held-out sample is weak."""
    from autotune.tuning.heldout import INTERVAL

    v = report.verdict
    n = len(v.plain.runs)
    prompts = f"{n} held-out prompt{'' if n == 1 else 's'}"
    if v.in_sample:
        prompts = f"{n} prompt the tuner saw (in-sample: --limit 2 or more holds prompts out)"
    elif n == 1:
        prompts += " (a weak check: --limit 10 holds out 3)"
    if report.refused:
        return "stored: plain decoding: a speculating candidate's output differed from plain decoding's"
    if not report.chosen.speculates:
        return f"stored: plain decoding: no candidate was reliably faster on {prompts}"
    text = f"stored: {strategy_in_words(report.chosen)}: {report.speedup:.2f}x plain on {prompts}"
    band = v.interval
    if band is not None and not v.in_sample and n > 1:
        text += f", {100 * INTERVAL:.0f}% interval {band[0]:.2f}-{band[1]:.2f}x"
    return text


def format_study(report: Any) -> str:
    """The headline, then the study's table (``autotune.tuning.study.StudyReport``)."""
    from rich.console import Console
    from rich.table import Table

    from autotune.tuning.heldout import describe

    t = report.tuner
    table = Table(title=f"study {report.name}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    plain_pred = t.get("plain_predicted_tps")
    rows = [
        ("stored", f"{describe(report.chosen)} in {report.storage_url} (history row {report.history_id}): "
                   f"{report.stored_reason}"),
        ("held-out speedup", _held_out_text(report)),
        ("incumbent", f"{report.best.to_json()} (the tuner's pick on the {report.tuned_prompts} prompt(s) it tuned "
                      "on; the held-out prompts judged it against the runner-ups and plain decoding)"),
        ("candidates", _candidates_text(report)),
        ("matchness", _matchness_text(report)),
        ("predicted tok/s", f"{t['best_predicted_tps']:.2f} for the incumbent"
         + (f" (plain {plain_pred:.2f})" if plain_pred else "") + _in_sample_text(report)),
        ("predicted / measured", _ratio_text(t.get("stored") or {})),
        ("uniform (start)", report.uniform.to_json()),
        ("trials", f"{t['trials']} ({t['stop_reason']}; {t.get('bayes_trials', 0)} Bayesian, "
                   f"{t.get('measured_trials', 0)} measured, {t.get('rival_trials', 0)} of them the nearest "
                   "rival's; "
                   f"{t.get('swept', 0)} grid points swept on "
                   f"{t.get('windows', 0)} windows)"),
        ("tuning share", f"{100 * report.tuning_share:.1f}% of decode time while tuning, spent window by window "
                         "(scoring, trials, races)"),
        ("one-time", _costs_text(t, report.tune_stats.wall_s)),
        ("while tuning", _while_tuning_text(report)),
        ("precision", _precision_text(report.extra.get("precision"))),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console = Console(width=120, record=True)
    with console.capture() as cap:
        console.print(table)
    return f"{headline(report)}\n{cap.get()}"


def _matchness_text(report: Any) -> str:
    """The incumbent's matchness, with what it measures (plain decoding drafts nothing: 0)."""
    m = report.tuner["best_matchness"]
    if not report.best.speculates:
        return f"{m:.3f} (the incumbent is plain decoding: it drafts nothing to match)"
    return f"{m:.3f} (the incumbent's drafts matching the target's tokens on the windows scored, 0..1)"


def _costs_text(t: dict[str, Any], decode_s: float) -> str:
    """Where the cost model's timings came from, and what timing them cost (once per models and
    machine, apart from the per-window share)."""
    seconds = t.get("calibration_s", 0.0)
    share = f"; {100 * seconds / decode_s:.1f}% of the {decode_s:.1f} s decoded" if decode_s > 0 and seconds else ""
    if t.get("costs") == "kept":
        return f"cost model from the store ({seconds:.1f} s timing plans first priced{share})"
    return f"{seconds:.1f} s timing the cost model (kept in the store for the next study{share})"


def _in_sample_text(report: Any) -> str:
    ins = report.in_sample_speedup
    return f"; {ins:.2f}x plain in-sample (predicted on the prompts it tuned on)" if ins else ""


def _held_out_text(report: Any) -> str:
    """The stored strategy's speed-up over plain decoding on prompts the tuner never saw, and how
    much that check is worth."""
    from autotune.tuning.heldout import INTERVAL, rests_on

    v = report.verdict
    n = len(v.plain.runs)
    text = (f"{report.speedup:.2f}x ({report.chosen_tps:.2f} tok/s vs plain {report.plain_tps:.2f}, "
            f"{n} prompt(s), outputs {'identical' if report.identical else 'DIFFERENT'})")
    if v.in_sample:
        return text + "; IN-SAMPLE: one prompt, nothing held out of tuning (--limit 2 or more holds prompts out)"
    if n == 1:
        return text + "; held out of tuning, but one prompt is a weak check (--limit 10 holds out 3)"
    band = v.interval
    if band is not None and report.chosen.speculates:
        text += f"; {100 * INTERVAL:.0f}% interval {band[0]:.2f}-{band[1]:.2f}x"
    return text + f"; on prompts held out of tuning; rests on {rests_on(v)}"


def _candidates_text(report: Any) -> str:
    """Each candidate of the held-out judgement: its speed-up and its lower bound (as stored)."""
    from autotune.tuning.heldout import describe

    parts = []
    for c, d in zip(report.verdict.candidates[1:], report.verdict.as_dict()["candidates"][1:]):
        shown = f"{math.exp(d['bound']):.2f}x" if d["bound"] > -math.inf else "-"
        parts.append(f"{c.label} ({describe(c.strategy)}): {d['speedup']:.2f}x "
                     f"(bound {shown}{'' if c.identical else ', output DIFFERED'})")
    return "; ".join(parts) or "none (the tuner kept plain decoding and scored nothing else)"


def _precision_text(info: dict[str, Any] | None) -> str:
    """The precision tuned at, and the fastest one predicted for the stored strategy and for plain."""
    if not info:
        return "-"
    from runtime.auto_precision import CANDIDATES
    from runtime.precision import auto_precision

    est = {e["precision"]: e for e in info["estimates"]}
    fastest, plain = info["fastest"], info["fastest_plain"]
    text = f"tuned at {info['precision']}"
    if info["precision"] in CANDIDATES and info["precision"] == auto_precision("cpu"):  # CPU-only precisions
        text += (f" (auto on this CPU: of {', '.join(CANDIDATES)}, whose speculation is exact relative to their plain "
                 "decoding, the one whose kernels ran a plain step and an 8-row verify fastest)")
    text += (f"; predicted fastest here: {fastest} for the stored strategy ({est[fastest]['chosen_tps']:.1f} tok/s), "
             f"{plain} for plain decoding ({est[plain]['plain_tps']:.1f} tok/s)")
    if fastest != info["precision"]:
        text += f"; tune at --precision {fastest} to check"
    not_timed = info.get("not_timed") or {}
    if not_timed:
        text += f"; not timed: {', '.join(not_timed)} ({next(iter(not_timed.values()))})"
    return text


def _while_tuning_text(report: Any) -> str:
    """Tokens/s over the study's prompts (prefill and tuning included), against plain decoding on
    the same prompts when ``--baseline`` measured it."""
    text = f"{report.tune_stats.tokens_per_s:.2f} tok/s"
    b = report.baseline
    if b is None:
        return text + " (--baseline measures plain decoding on the same prompts)"
    return (f"{text} vs plain {b.plain.tokens_per_s:.2f} on the same prompts, interleaved ({b.ratio:.2f}x); "
            f"outputs {'identical' if b.identical else 'DIFFERENT'} on every prompt")


def _ratio_text(stored: dict[str, Any]) -> str:
    """The stored strategy's prediction against its decode-round speed on the held-out prompts:
    priced on their own text (the cost model and the pricing of matches), and predicted from the
    prompts tuned on (that and how far the task's text varies)."""
    on = stored.get("on", "held-out prompts")
    parts = []
    if stored.get("ratio"):
        parts.append(f"{stored['ratio']:.2f} (predicted {stored['predicted_tps']:.2f} tok/s on the {on}' own text, "
                     f"decode rounds measured {stored['decode_tps']:.2f})")
    if stored.get("task_ratio"):
        parts.append(f"{stored['task_ratio']:.2f} from the prompts tuned on ({stored['task_predicted_tps']:.2f} tok/s)")
    return "; ".join(parts) or "-"
