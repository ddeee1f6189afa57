"""``autotune loadtest``'s picture: aggregate tok/s and p50 latency against concurrency, one line per
(server, mode), and, where ``--compare`` found comparisons, a third panel of the compared mode's
ratio to the best other mode (solid) and to the best peer (dashed) with their 95% intervals."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from autotune.measure.loadtest import PEER_MODE
from autotune.reports.figure import DPI, note, save_figure


def load_plot(points: Sequence[Any], path: Path | str, comparisons: Sequence[Any] = ()) -> Path:
    """``points``: throughput (left) and p50 latency (middle) against concurrency, one line per
    (server, mode); ``comparisons`` (``loadtest.Comparison``): their ratios (right), when any."""
    panels = 3 if comparisons else 2
    fig = Figure(figsize=(5.0 * panels, 4.0), dpi=DPI)
    FigureCanvasAgg(fig)
    tput, lat = fig.add_subplot(1, panels, 1), fig.add_subplot(1, panels, 2)
    lines: dict[tuple[str, str], list[Any]] = {}
    for p in points:
        lines.setdefault((p.server, p.mode), []).append(p)
    servers = list(dict.fromkeys(p.server for p in points))
    for (server, mode), pts in lines.items():
        pts = sorted(pts, key=lambda p: p.concurrency)
        style = "-o" if server == servers[0] else "--s"
        label = server if mode == PEER_MODE else mode if len(servers) == 1 else f"{mode} ({server})"
        xs = [p.concurrency for p in pts]
        tput.plot(xs, [p.tokens_per_s for p in pts], style, label=label)
        lat.plot(xs, [p.latency_p50_s for p in pts], style, label=label)
    for ax, ylabel in ((tput, "aggregate tok/s"), (lat, "p50 latency (s)")):
        _concurrency_axis(ax, ylabel)
        if not points:
            note(ax, "no points")
    tput.legend(fontsize=8)
    tput.set_title("throughput", fontsize=10)
    lat.set_title("latency", fontsize=10)
    if comparisons:
        ratio_panel(fig.add_subplot(1, panels, 3), comparisons)
    return save_figure(fig, path)


def ratio_panel(ax: Any, comparisons: Sequence[Any]) -> None:
    """Each (server, mode, kind) series of comparisons: the pooled ratio against concurrency, its 95%
    interval as error bars (none with one round), the peer at each point named beside it."""
    series: dict[tuple[str, str, bool], list[Any]] = {}
    for c in comparisons:
        series.setdefault((c.server, c.mode, c.paired), []).append(c)
    for (server, mode, paired), cs in series.items():
        cs = sorted(cs, key=lambda c: c.concurrency)
        xs, ys = [c.concurrency for c in cs], [c.ratio for c in cs]
        lows = [c.ratio - c.low if c.low is not None else 0.0 for c in cs]
        highs = [c.high - c.ratio if c.high is not None else 0.0 for c in cs]
        kind = "best other mode" if paired else "best peer"
        ax.errorbar(xs, ys, yerr=[lows, highs], fmt="-o" if paired else "--s", capsize=3,
                    label=f"{mode} ({server}) / {kind}")
        if not paired:
            for c in cs:
                ax.annotate(c.against, (c.concurrency, c.ratio), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(1.0, color="0.5", linewidth=0.8)
    _concurrency_axis(ax, "tok/s ratio (95% interval)")
    ax.legend(fontsize=8)
    ax.set_title("against the best other", fontsize=10)


def _concurrency_axis(ax: Any, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
