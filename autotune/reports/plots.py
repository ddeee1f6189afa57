"""Pictures of a study and of a bench run: PNGs (matplotlib, Agg canvas, no global pyplot state)
and one ``index.html`` per study that ties them together.

Every function here renders plain data (trials, the study's ``kept`` list, ``DecodeStats.as_dict()``,
a bench report dict); nothing decodes or tunes. ``STUDY_PLOTS`` is the registry of the per-study
plots: ``write_study_report`` renders each one whose data the study holds and lists the others in
the page as skipped.
"""
from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from autotune.reports.figure import new_figure, note, save_figure

INDEX = "index.html"
MIN_SLOTS = 6  # bar charts keep room for this many bars, so one bar is not a wall
SAMPLERS = {  # trial user attr "sampler" -> (legend label, marker, colour); missing -> "random"
    "random": ("random", "o", "tab:blue"),
    "bayes": ("Bayesian", "^", "tab:orange"),
    "enqueued": ("enqueued (start)", "s", "tab:green"),
    "sweep": ("grid sweep (raced)", "D", "tab:purple"),
}


def strategy_label(strategy: dict[str, Any]) -> str:
    """A short name for a strategy dict: its drafter and draft length ("plain" for no drafter)."""
    drafter = strategy.get("drafter", "?")
    if drafter == "none":
        return "plain"
    return f"{drafter} k={strategy.get('draft_length', '?')}"


# ---------------------------------------------------------------------- study plots
def tuning_curve(trials: Sequence[Any], kept: Sequence[dict[str, Any]], path: Path | str,
                 plain_tps: float | None = None, switches: Iterable[int] = ()) -> Path:
    """Predicted tok/s per trial by sampler, the tuner's incumbent as a step line, its switches
    marked (trial user attr ``switched``, the trials of ``kept``, and ``switches``), and plain
    decoding's predicted tok/s when known. ``trials``: objects with ``number``, ``value`` and
    ``user_attrs`` (Optuna's ``FrozenTrial``)."""
    fig, ax = new_figure()
    done = sorted((t for t in trials if t.value is not None and math.isfinite(t.value)), key=lambda t: t.number)
    for sampler, (label, marker, colour) in SAMPLERS.items():
        pts = [(t.number, t.value) for t in done if _sampler(t) == sampler]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=colour, s=22, alpha=0.75, label=f"{label} trial")
    switches = _switch_trials(done, kept) | {int(n) for n in switches}
    if done:
        xs, ys, label = _incumbent_steps(done, switches, _start_value(kept, plain_tps))
        ax.step(xs, ys, where="post", color="black", linewidth=1.5, label=label)
        hits = [(t.number, t.value) for t in done if t.number in switches]
        if hits:
            ax.scatter(*zip(*hits), marker="*", s=160, facecolor="gold", edgecolor="black", zorder=5,
                       label="kept (switched in)")
    else:
        note(ax, "no completed trials")
    if plain_tps:
        ax.axhline(plain_tps, color="tab:red", linestyle="--", linewidth=1, label=f"plain decoding ({plain_tps:.1f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel("predicted tok/s")
    ax.set_title("tuning curve")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # beside the axes: trials fill the whole plot
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return save_figure(fig, path)


def _sampler(trial: Any) -> str:
    name = trial.user_attrs.get("sampler", "random")
    return name if name in SAMPLERS else "random"


def _switch_trials(trials: Iterable[Any], kept: Sequence[dict[str, Any]]) -> set[int]:
    """Trial numbers where the tuner switched strategy: user attr ``switched``, or a kept entry."""
    marked = {t.number for t in trials if t.user_attrs.get("switched") is True}
    return marked | {int(k["trial"]) for k in kept if isinstance(k.get("trial"), int) and k["trial"] >= 0}


def _start_value(kept: Sequence[dict[str, Any]], plain_tps: float | None) -> float | None:
    """Predicted tok/s of the strategy the tuner held before its first kept trial: the last kept
    entry without a trial number (plain decoding: ``plain_tps``); None when unknown."""
    before = []
    for k in kept:
        if isinstance(k.get("trial"), int) and k["trial"] >= 0:
            break
        before.append(k)
    if not before:
        return None
    start = before[-1]
    if (start.get("strategy") or {}).get("drafter") == "none" and plain_tps:
        return float(plain_tps)
    predicted = start.get("predicted_tps")
    return float(predicted) if predicted else None  # 0: never scored


def _incumbent_steps(done: Sequence[Any], switches: set[int], start: float | None) -> tuple[list[int], list[float], str]:
    """The incumbent's predicted tok/s from trial to trial: ``start``, then the value of the last
    switched-in trial; with neither known, the best value so far."""
    if start is None and not switches & {t.number for t in done}:
        best, ys = float("-inf"), []
        for t in done:
            best = max(best, t.value)
            ys.append(best)
        return [t.number for t in done], ys, "best so far"
    xs, ys, current = [], [], start
    for t in done:
        if t.number in switches:
            current = t.value
        if current is not None:
            xs.append(t.number)
            ys.append(current)
    return xs, ys, "incumbent (as predicted when kept)"


def acceptance_by_position(stats: dict[str, Any], path: Path | str) -> Path:
    """Acceptance rate at each draft position (``stats["position_acceptance"]``, index i = position i+1)."""
    fig, ax = new_figure()
    rates = list(stats.get("position_acceptance") or [])
    if rates:
        positions = range(1, len(rates) + 1)
        bars = ax.bar(positions, rates, color="tab:blue")
        ax.bar_label(bars, labels=[f"{r:.2f}" for r in rates], fontsize=7, padding=2)
        ax.set_xticks(list(positions))
        ax.set_xlim(0.4, max(len(rates), MIN_SLOTS) + 0.6)
    else:
        note(ax, "nothing was drafted")
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    alpha = stats.get("acceptance_rate")
    ax.set_title("acceptance by draft position" + (f" (overall alpha {alpha:.2f})" if alpha is not None else ""))
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def accepted_histogram(stats: dict[str, Any], path: Path | str) -> Path:
    """Verify rounds by how many drafted tokens they accepted (``stats["accept_hist"]``)."""
    fig, ax = new_figure()
    counts = list(stats.get("accept_hist") or [])
    if counts:
        bars = ax.bar(range(len(counts)), counts, color="tab:purple")
        ax.bar_label(bars, fontsize=7, padding=2)
        ax.set_xticks(list(range(len(counts))))
        ax.set_xlim(-0.6, max(len(counts), MIN_SLOTS) - 0.4)
    else:
        note(ax, "no verify round checked a draft")
    ax.set_xlabel("drafted tokens accepted in the round")
    ax.set_ylabel("rounds")
    m = stats.get("mean_accepted")
    ax.set_title("accepted tokens per round" + (f" (M {m:.2f} tokens per target forward)" if m else ""))
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def predicted_vs_measured(kept: Sequence[dict[str, Any]], path: Path | str,
                          rejected: Sequence[dict[str, Any]] = ()) -> Path:
    """Each kept strategy's predicted against measured tok/s, with the y = x line; ``rejected``
    (candidates measured and not kept, same keys) are drawn as grey crosses."""
    fig, ax = new_figure()
    missed = [(float(k["predicted_tps"]), float(k["measured_tps"])) for k in rejected
              if k.get("predicted_tps") and k.get("measured_tps") is not None]
    measured = [k for k in kept if k.get("measured_tps") is not None]
    pts = [k for k in measured if k.get("predicted_tps")]  # 0 / None: kept before it was ever scored
    if len(pts) < len(measured):
        n = len(measured) - len(pts)
        fig.text(0.01, 0.01, f"{n} measured strategy(ies) without a prediction not shown", fontsize=7, color="0.4")
    if pts:
        xs = [float(k["predicted_tps"]) for k in pts]
        ys = [float(k["measured_tps"]) for k in pts]
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        if missed:
            ax.scatter(*zip(*missed), marker="x", color="0.5", zorder=2, label="measured, not kept")
        lo, hi = 0.0, 1.15 * max(xs + ys + [v for pt in missed for v in pt]) or 1.0  # from 0: offsets read as ratios
        for k, x, y in zip(pts, xs, ys):
            right = x > 0.6 * hi  # labels of points near the right edge go to their left
            ax.annotate(f"{_trial_tag(k)} {strategy_label(k.get('strategy') or {})}", (x, y), fontsize=7,
                        xytext=(-4 if right else 4, 4), textcoords="offset points", ha="right" if right else "left")
        ax.plot([lo, hi], [lo, hi], color="0.5", linestyle="--", linewidth=1, label="measured = predicted")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.legend(fontsize=8, loc="upper left")
    else:
        note(ax, "no kept strategy has a measured tok/s yet")
    ax.set_xlabel("predicted tok/s")
    ax.set_ylabel("measured tok/s")
    ax.set_title("kept strategies: predicted vs measured")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def held_out_spread(heldout: dict[str, Any], path: Path | str) -> Path:
    """Each candidate of a study's held-out judgement: its speed-up over plain decoding on every
    held-out prompt (dots, a box where there are enough), the aggregate speed-up (a bar) and the
    lower bound the choice was made on (a tick); the stored one is named in the title."""
    fig, ax = new_figure()
    cands = [c for c in heldout.get("candidates") or () if c.get("label") != "plain"]
    if not cands:
        note(ax, "plain decoding was the only candidate (the tuner scored nothing else)")
    else:
        labels = [f"{c['label']}\n{strategy_label(c.get('strategy') or {})}" for c in cands]
        for x, c in enumerate(cands):
            ups = [float(u) for u in c.get("speedups") or ()]
            if len(ups) >= 4:
                ax.boxplot([ups], positions=[x], widths=0.35, showfliers=False, manage_ticks=False)
            offsets = [(i - (len(ups) - 1) / 2) * 0.04 for i in range(len(ups))]
            ax.scatter([x + o for o in offsets], ups, color="tab:blue" if c.get("identical", True) else "tab:red",
                       zorder=3, s=18, label="one held-out prompt" if x == 0 else None)
            if c.get("speedup"):
                ax.bar([x], [float(c["speedup"])], width=0.6, color="tab:blue", alpha=0.15, zorder=1,
                       label="all held-out prompts" if x == 0 else None)
            bound = c.get("bound")
            if isinstance(bound, (int, float)) and math.isfinite(bound):
                ax.hlines(math.exp(bound), x - 0.3, x + 0.3, color="tab:orange", linewidth=2, zorder=4,
                          label="lower bound (chosen on)" if x == 0 else None)
        ax.set_xticks(range(len(cands)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="plain decoding")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    n = heldout.get("prompts", 0)
    where = "in-sample prompt (nothing held out)" if heldout.get("in_sample") else "held-out prompt(s)"
    ax.set_title(f"speed-up over plain on {n} {where}; stored: {heldout.get('chosen', '-')}", fontsize=9)
    ax.set_ylabel("tok/s / plain decoding's tok/s")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def _trial_tag(k: dict[str, Any]) -> str:
    trial = k.get("trial")
    return f"#{trial}" if isinstance(trial, int) and trial >= 0 else "start"


# ---------------------------------------------------------------------- the study page
@dataclass(frozen=True)
class StudyData:
    """What the study plots read, taken from an Optuna study once."""

    name: str
    trials: tuple[Any, ...]  # COMPLETE FrozenTrials
    kept: tuple[dict[str, Any], ...]
    tune_stats: dict[str, Any] | None
    plain_tps: float | None
    switches: tuple[int, ...] = ()  # trial numbers the tuner switched to
    rejected: tuple[dict[str, Any], ...] = ()  # candidates measured and not kept
    heldout: dict[str, Any] | None = None  # the held-out judgement (``autotune.tuning.heldout``)

    @classmethod
    def from_study(cls, study: Any) -> "StudyData":
        import optuna

        attrs = study.user_attrs
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return cls(
            name=study.study_name, trials=tuple(complete), kept=tuple(attrs.get("kept") or ()),
            tune_stats=attrs.get("tune_stats"), plain_tps=attrs.get("plain_predicted_tps"),
            switches=tuple(n for n in attrs.get("switches") or () if isinstance(n, int)),
            rejected=tuple(attrs.get("rejected") or ()), heldout=attrs.get("heldout"),
        )


@dataclass(frozen=True)
class StudyPlot:
    file: str
    caption: str
    render: Callable[[StudyData, Path], Path]
    missing: Callable[[StudyData], str | None] = lambda data: None  # why it cannot be drawn, or None


def _no_tune_stats(data: StudyData) -> str | None:
    return None if data.tune_stats else "the study has no 'tune_stats' user attribute"


STUDY_PLOTS: dict[str, StudyPlot] = {
    "tuning_curve": StudyPlot(
        "tuning_curve.png",
        "Predicted tok/s of every trial (marker = sampler), the incumbent the tuner decoded with, its switches, "
        "and plain decoding's predicted tok/s.",
        lambda d, p: tuning_curve(d.trials, d.kept, p, plain_tps=d.plain_tps, switches=d.switches),
    ),
    "acceptance_by_position": StudyPlot(
        "acceptance_by_position.png", "Acceptance rate at each draft position while tuning.",
        lambda d, p: acceptance_by_position(d.tune_stats or {}, p), _no_tune_stats,
    ),
    "accepted_histogram": StudyPlot(
        "accepted_histogram.png", "Verify rounds by the number of drafted tokens accepted.",
        lambda d, p: accepted_histogram(d.tune_stats or {}, p), _no_tune_stats,
    ),
    "predicted_vs_measured": StudyPlot(
        "predicted_vs_measured.png",
        "Every strategy the tuner kept: the cost model's predicted tok/s against the tok/s measured while it "
        "decoded (crosses: candidates measured and not kept).",
        lambda d, p: predicted_vs_measured(d.kept, p, d.rejected),
    ),
    "held_out": StudyPlot(
        "held_out.png",
        "The held-out judgement: each candidate's speed-up over plain decoding on every prompt held out of "
        "tuning (dots; red: output differed), over all of them (bar), and the lower bound it was chosen on.",
        lambda d, p: held_out_spread(d.heldout or {}, p),
        lambda d: None if d.heldout else "the study has no 'heldout' user attribute (made before held-out judging)",
    ),
}


def write_study_report(study: Any, out_dir: Path | str) -> Path:
    """Render ``study``'s plots into ``out_dir`` (created) with an ``index.html``; returns its path."""
    return write_report_dir(StudyData.from_study(study), out_dir)


def write_report_dir(data: StudyData, out_dir: Path | str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn: list[StudyPlot] = []
    skipped: list[tuple[StudyPlot, str]] = []
    for plot in STUDY_PLOTS.values():
        reason = plot.missing(data)
        if reason:
            skipped.append((plot, reason))
        else:
            plot.render(data, out / plot.file)
            drawn.append(plot)
    index = out / INDEX
    index.write_text(study_page(data, drawn, skipped), encoding="utf-8")
    return index


def study_page(data: StudyData, drawn: Sequence[StudyPlot], skipped: Sequence[tuple[StudyPlot, str]]) -> str:
    e = html.escape
    parts = [_head(data.name), f"<h1>{e(data.name)}</h1>", f"<p>{len(data.trials)} completed trials"]
    if data.plain_tps:
        parts[-1] += f"; plain decoding predicted at {data.plain_tps:.2f} tok/s"
    parts[-1] += ".</p>"
    parts.append(_kept_table(data.kept))
    for plot in drawn:
        parts.append(f'<figure><img src="{e(plot.file)}" alt="{e(plot.file)}">'
                     f"<figcaption>{e(plot.caption)}</figcaption></figure>")
    if skipped:
        items = "".join(f"<li>{e(p.file)}: {e(reason)}</li>" for p, reason in skipped)
        parts.append(f"<h2>Skipped</h2><ul>{items}</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _kept_table(kept: Sequence[dict[str, Any]]) -> str:
    if not kept:
        return "<p>No kept strategies recorded (the study has no 'kept' user attribute).</p>"
    head = "<tr><th>trial</th><th>strategy</th><th>predicted tok/s</th><th>measured tok/s</th><th>predicted / measured</th>" \
           "<th>matchness</th><th>tokens</th></tr>"
    rows = []
    for k in kept:
        pred, meas = k.get("predicted_tps"), k.get("measured_tps")
        ratio = k.get("ratio")
        if ratio is None and pred and meas:
            ratio = pred / meas  # as the tuner writes it
        cells = (_trial_tag(k), strategy_label(k.get("strategy") or {}), _num(pred or None), _num(meas), _num(ratio),
                 _num(k.get("matchness"), "{:.3f}"), k.get("tokens", ""))
        title = html.escape(json.dumps(k.get("strategy"), sort_keys=True), quote=True)
        rows.append(f'<tr title="{title}">' + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<h2>Kept strategies</h2><table>{head}{''.join(rows)}</table>"


def _num(value: Any, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def _head(title: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;max-width:60em;margin:1em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555}"
        "</style></head><body>"
    )


def index_page(title: str, links: Sequence[tuple[str, str, str]]) -> str:
    """A page linking sub-reports: ``links`` are (href, text, note) triples."""
    e = html.escape
    items = "".join(f'<li><a href="{e(href)}">{e(text)}</a> {e(note)}</li>' for href, text, note in links)
    return "\n".join([_head(title), f"<h1>{e(title)}</h1>", f"<ul>{items}</ul>", "</body></html>\n"])


# ---------------------------------------------------------------------- bench
def _short_method(name: str) -> str:
    """A bench method label for an axis: ``tuned:db=/long/path/auto.db`` -> ``tuned:db=auto.db``."""
    parts = name.split(":")
    return ":".join(f"db={Path(p[3:]).name}" if p.startswith("db=") else p for p in parts)


def bench_plot(report: dict[str, Any], path: Path | str) -> Path:
    """Tok/s of each bench method side by side (``autotune.measure.bench.summarise``'s report), the speedup
    over the baseline on each bar; methods whose output differed from the baseline are hatched red."""
    fig, ax = new_figure()
    methods = report.get("methods") or {}
    baseline = report.get("baseline")
    names = list(methods)
    tps = [float(methods[n].get("tokens_per_s") or 0.0) for n in names]
    # None: another engine (bench peer), compared by agreement instead of identity
    same = [methods[n].get("identical_to_baseline", True) is not False for n in names]
    colours = ["tab:gray" if n == baseline else ("tab:blue" if ok else "tab:red") for n, ok in zip(names, same)]
    bars = ax.bar(range(len(names)), tps, color=colours, edgecolor="black", linewidth=0.5)
    for bar, ok in zip(bars, same):
        if not ok:
            bar.set_hatch("//")
    labels = []
    for n, ok in zip(names, same):
        speedup = methods[n].get("speedup_vs_baseline")
        text = "-" if speedup is None else f"{speedup:.2f}x"
        agree = methods[n].get("agreement") if methods[n].get("identical_to_baseline", True) is None else None
        labels.append(f"{text}\nagree {agree:.2f}" if agree is not None else (text if ok else f"{text}\nNOT identical"))
    ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
    ticks = [_short_method(n) for n in names]
    ax.set_xticks(range(len(names)), ticks, rotation=20 if len(names) > 4 or max(map(len, ticks), default=0) > 14 else 0,
                  fontsize=8)
    ax.set_ylabel("tok/s")
    ax.set_ylim(0, max(tps, default=1.0) * 1.25 or 1.0)
    cfg = report.get("config") or {}
    where = " / ".join(str(cfg[k]) for k in ("model", "task") if cfg.get(k))
    ax.set_title(f"bench (baseline: {baseline})" + (f": {where}" if where else ""), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if not names:
        note(ax, "no methods in the report")
    return save_figure(fig, path)
