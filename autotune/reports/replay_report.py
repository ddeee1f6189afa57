"""The report of an ``autotune replay`` run: figures per category and mode, the identical-output
check across modes, a rich table, the JSON file and the tok/s-over-the-stream plot.

Everything here is a pure function of replay records
(:class:`autotune.measure.replay.ReplayRecord`; no server). Tok/s is total completion
tokens / total decode time (each request's tokens over its tok/s, its prefill included); "after
1st" is the tokens after each request's first over the time after it (its prefill left out);
acceptance is accepted / drafted, M is (accepted + draft rounds) / draft rounds (1 with no
drafts), switches count changes of the strategy label between consecutive requests of a category, and tuning counts
requests answered while their route re-tuned. For requests a controller drove (``auto`` on a
server with request control): the share of them whose controller switched strategy, their final
strategies, and the controller's cost (its scoring time over their decode time). Where the
server collected ``unknown`` requests into pending clusters (``serve --adaptive``), the adjusted
Rand index of those clusters against the stream's categories. A request sent in several rounds
(``replay --repeat``) counts once per mode, at its median over the rounds (``combined``), and the
report shows how far a mode's second round ran from its first (``repeat_spread``) and, per
category, a bootstrap interval of each mode's tok/s over plain's (``vs_plain_intervals``).
"""
from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.measure.replay import CHOSEN, ReplayRecord

ALL = "all"
"""The category name of the rows over the whole stream."""
LENGTH_BANDS: tuple[tuple[str, float], ...] = (("<=32", 32), ("33-96", 96), (">96", float("inf")))
"""Response length bands (completion tokens, at most): short answers apart from the rest."""


def categories(records: Sequence[ReplayRecord]) -> list[str]:
    """Categories in the order the stream first reaches them."""
    seen: dict[str, None] = {}
    for record in sorted(records, key=lambda r: r.index):
        seen.setdefault(record.category, None)
    return list(seen)


def switches(records: Sequence[ReplayRecord]) -> int:
    """Changes of the strategy label between consecutive requests of each category, summed."""
    labels: dict[str, list[str]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r.index):
        labels[record.category].append(record.strategy)
    return sum(sum(a != b for a, b in zip(seq, seq[1:])) for seq in labels.values())


def group_stats(records: Sequence[ReplayRecord]) -> dict[str, Any]:
    """The figures of one group of records (one mode; one category or all)."""
    tokens = sum(r.completion_tokens for r in records)
    decode_s = sum(r.decode_s for r in records)
    drafted, accepted = sum(r.drafted for r in records), sum(r.accepted for r in records)
    rounds = sum(r.draft_rounds for r in records)
    routes = Counter(str(r.route) for r in records)
    n = len(records)
    after_first_s = sum(max(r.latency_s - r.ttft_s, 0.0) for r in records)
    controlled = [r for r in records if r.control_switches is not None]
    control_decode_s = sum(r.decode_s for r in controlled)
    return {
        "requests": n, "completion_tokens": tokens, "decode_s": decode_s,
        "tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,
        # the tokens after the first over the time after it: decoding alone, each prompt's prefill left
        # out (the same work in every mode, whose spread between two sends is the machine's, not a mode's)
        "after_first_tokens_per_s": sum(max(r.completion_tokens - 1, 0) for r in records) / after_first_s
        if after_first_s > 0 else 0.0,
        "drafted": drafted, "accepted": accepted, "draft_rounds": rounds,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_accepted": (accepted + rounds) / rounds if rounds else 1.0,
        "route": routes.most_common(1)[0][0] if routes else None, "routes": dict(routes.most_common()),
        "strategies": dict(Counter(r.strategy for r in records).most_common()),
        "switches": switches(records), "tuning_requests": sum(r.state == "tuning" for r in records),
        "controlled": len(controlled),
        "controller_switched": sum(bool(r.control_switches) for r in controlled) / len(controlled) if controlled else None,
        "controller_finals": dict(Counter(str(r.control_final) for r in controlled).most_common()),
        "controller_share": sum(r.control_s for r in controlled) / control_decode_s if control_decode_s > 0 else None,
        "mean_ttft_s": sum(r.ttft_s for r in records) / n if n else 0.0,
        "mean_latency_s": sum(r.latency_s for r in records) / n if n else 0.0,
    }


def identical(records: Sequence[ReplayRecord], modes: Sequence[str]) -> dict[str, Any]:
    """Per request: whether every mode, in every round, returned the same token ids (requests some
    mode lacks count as differing; ``chosen`` is sent only where it could be forced, and compared
    where it was)."""
    outputs: dict[int, dict[str, set[tuple[int, ...]]]] = defaultdict(dict)
    for record in records:
        outputs[record.index].setdefault(record.mode, set()).add(record.token_ids)
    required = set(modes) - {CHOSEN}
    differing = sorted(i for i, by_mode in outputs.items()
                       if not required <= set(by_mode) or len(set().union(*by_mode.values())) > 1)
    return {"requests": len(outputs), "modes": list(modes), "differ": len(differing), "differing": differing}


def combined(records: Sequence[ReplayRecord]) -> list[ReplayRecord]:
    """One record per (request, mode), in the order first sent: a request sent in several rounds
    has its latency, first-token time and decode time at the median over its rounds (two rounds:
    their mean), the rest as its first round answered."""
    rounds: dict[tuple[int, str], list[ReplayRecord]] = {}
    for record in records:
        rounds.setdefault((record.index, record.mode), []).append(record)
    out = []
    for sends in rounds.values():
        first = min(sends, key=lambda r: r.send)
        if len(sends) == 1:
            out.append(first)
            continue
        decode_s = statistics.median(r.decode_s for r in sends)
        out.append(replace(first, latency_s=statistics.median(r.latency_s for r in sends),
                           ttft_s=statistics.median(r.ttft_s for r in sends),
                           tokens_per_s=first.completion_tokens / decode_s if decode_s > 0 else 0.0))
    return out


def repeat_spread(records: Sequence[ReplayRecord], modes: Sequence[str]) -> dict[str, dict[str, float]] | None:
    """Per mode, per category and over all (:data:`ALL`): the latency of the requests' second round
    over their first, summed over the requests sent twice or more (1: both rounds ran alike). For
    ``plain``, whose two rounds do the same work, it is the run's own spread between two sends: the
    floor under any figure comparing two modes of one round. None when no request was sent twice."""
    first = {(r.index, r.mode): r for r in records if r.send == 0}
    pairs = [(first[(r.index, r.mode)], r) for r in records if r.send == 1 and (r.index, r.mode) in first]
    if not pairs:
        return None
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [(a, b) for a, b in pairs if a.mode == mode]
        names = [*categories([a for a, _ in mine]), ALL]
        groups = {c: [(a, b) for a, b in mine if c in (ALL, a.category)] for c in names}
        out[mode] = {c: sum(b.latency_s for _, b in group) / first_s for c, group in groups.items()
                     if (first_s := sum(a.latency_s for a, _ in group)) > 0}
    return out


INTERVAL_LEVEL = 0.9
"""The coverage of ``vs_plain_intervals`` (a two-sided percentile interval)."""
BOOTSTRAP_SAMPLES = 2000


def _ratio_of_sums(mode_tokens: Any, mode_s: Any, plain_tokens: Any, plain_s: Any, axis: int = -1) -> Any:
    """tok/s of one mode over plain's, each as its tokens over its decode time summed (the rows')."""
    return (mode_tokens.sum(axis) / mode_s.sum(axis)) / (plain_tokens.sum(axis) / plain_s.sum(axis))


def vs_plain_intervals(records: Sequence[ReplayRecord], modes: Sequence[str], samples: int = BOOTSTRAP_SAMPLES,
                       level: float = INTERVAL_LEVEL, seed: int = 0) -> dict[str, dict[str, list[float]]] | None:
    """Per mode but ``plain``, per category and over all (:data:`ALL`): a paired bootstrap interval
    ``[low, high]`` (``scipy.stats.bootstrap``, percentile) of its tok/s over plain decoding's,
    resampling the requests both modes answered. How far a category's ratio can be told from 1
    with this many requests. ``records`` as ``aggregate`` counts them (``combined``); a group of
    fewer than two requests, or with no decode time, has none; None without ``plain``. Seeded:
    the same records give the same intervals."""
    import numpy as np
    from scipy.stats import bootstrap

    if "plain" not in modes:
        return None
    by_key = {(r.index, r.mode): r for r in records}
    out: dict[str, dict[str, list[float]]] = {}
    for mode in (m for m in modes if m != "plain"):
        pairs = [(r, by_key[(r.index, "plain")]) for r in records if r.mode == mode and (r.index, "plain") in by_key]
        pairs = [(a, b) for a, b in pairs if a.decode_s > 0 and b.decode_s > 0]
        per: dict[str, list[float]] = {}
        for category in [*categories([a for a, _ in pairs]), ALL]:
            group = [(a, b) for a, b in pairs if category in (ALL, a.category)]
            if len(group) < 2:
                continue
            columns = np.array([(a.completion_tokens, a.decode_s, b.completion_tokens, b.decode_s) for a, b in group],
                               dtype=float).T
            ci = bootstrap(tuple(columns), _ratio_of_sums, paired=True, vectorized=True, n_resamples=samples,
                           confidence_level=level, method="percentile", random_state=np.random.default_rng(seed)).confidence_interval
            per[category] = [float(ci.low), float(ci.high)]
        out[mode] = per
    return out


def band_of(tokens: int) -> str:
    """The length band of a response of ``tokens`` completion tokens (``LENGTH_BANDS``)."""
    return next(name for name, top in LENGTH_BANDS if tokens <= top)


def bands(records: Sequence[ReplayRecord], modes: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (length band, mode) present: the band's figures (``group_stats``) and its tok/s as
    a share of plain decoding's on the same requests (None without a ``plain`` mode)."""
    rows = []
    for name, _ in LENGTH_BANDS:
        of_band = [r for r in records if band_of(r.completion_tokens) == name]
        if not of_band:
            continue
        plain = group_stats([r for r in of_band if r.mode == "plain"]) if "plain" in modes else None
        for mode in modes:
            stats = group_stats([r for r in of_band if r.mode == mode])
            share = stats["tokens_per_s"] / plain["tokens_per_s"] if plain and plain["tokens_per_s"] else None
            rows.append({"band": name, "mode": mode, **stats, "vs_plain": share})
    return rows


def forced(records: Sequence[ReplayRecord]) -> dict[str, Any] | None:
    """``auto`` beside its own choice forced (mode ``chosen``), per length band and over all: the
    pairs compared, how many drafted identically (same drafted and accepted tokens), and the
    latency and time-to-first-token ratios forced / auto (1: auto costs nothing beside the strategy
    it picked; 0.98: 2% more). None without ``chosen`` records."""
    by_index = {(r.index, r.mode): r for r in records}
    pairs = [(by_index[(r.index, "auto")], r) for r in records if r.mode == CHOSEN and (r.index, "auto") in by_index]
    if not pairs:
        return None

    def figures(group: Sequence[tuple[ReplayRecord, ReplayRecord]]) -> dict[str, Any]:
        auto_s, forced_s = sum(a.latency_s for a, _ in group), sum(f.latency_s for _, f in group)
        auto_t, forced_t = sum(a.ttft_s for a, _ in group), sum(f.ttft_s for _, f in group)
        same = [(a, f) for a, f in group if (a.drafted, a.accepted) == (f.drafted, f.accepted)]
        same_auto, same_forced = sum(a.latency_s for a, _ in same), sum(f.latency_s for _, f in same)
        return {"pairs": len(group), "same_drafting": len(same), "auto_latency_s": auto_s,
                "forced_latency_s": forced_s, "latency_ratio": forced_s / auto_s if auto_s > 0 else None,
                "ttft_ratio": forced_t / auto_t if auto_t > 0 else None,
                "same_drafting_latency_ratio": same_forced / same_auto if same_auto > 0 else None}

    out = {name: figures([p for p in pairs if band_of(p[0].completion_tokens) == name])
           for name, _ in LENGTH_BANDS if any(band_of(a.completion_tokens) == name for a, _ in pairs)}
    return {**out, ALL: figures(pairs)}


def clustering(records: Sequence[ReplayRecord], stored_tasks: Sequence[str] | None = None) -> dict[str, Any] | None:
    """How the server's pending clusters (``serve --adaptive``: the ``unknown`` requests it
    collects into new routes) match the stream's categories: the adjusted Rand index of cluster
    ids against categories over the requests that joined one (1: the categories exactly; ~0:
    chance), or None when no response named a cluster. With the server's ``stored_tasks``, also
    over the **unseen** categories only (no stored task of that name): the traffic new routes are
    for. A studied category's requests that route to ``unknown`` (MT-Bench's open questions, far
    from the prompts studied) are each their own kind of text and count in the first figure."""
    joined = [r for r in sorted(records, key=lambda r: r.index) if r.cluster is not None]
    if not joined:
        return None
    out = _rand(joined)
    if stored_tasks is not None:
        studied = set(stored_tasks)
        unseen = [r for r in joined if r.category not in studied]
        out["unseen"] = _rand(unseen) if unseen else None
    return out


def _rand(joined: Sequence[ReplayRecord]) -> dict[str, Any]:
    from sklearn.metrics import adjusted_rand_score

    cats = [r.category for r in joined]
    ids = [r.cluster for r in joined]
    return {"requests": len(joined), "categories": len(set(cats)), "clusters": len(set(ids)),
            "ari": float(adjusted_rand_score(cats, ids)),
            "by_category": {c: sorted({r.cluster for r in joined if r.category == c}) for c in dict.fromkeys(cats)}}


def aggregate(records: Sequence[ReplayRecord], modes: Sequence[str],
              route_retunes: Mapping[str, int] | None = None, stored_tasks: Sequence[str] | None = None) -> dict[str, Any]:
    """The report: one row per (category, mode) and per mode over the whole stream (category
    :data:`ALL`), the identical-output check, the server's re-tunes per route when it reported
    them, and the pending clusters against the categories (``stored_tasks``: see ``clustering``).
    Every round of a repeated request is checked for identical outputs; the figures count it once
    per mode (``combined``), and ``repeat_spread`` compares its rounds."""
    same, spread = identical(records, modes), repeat_spread(records, modes)
    records = combined(records)
    intervals = vs_plain_intervals(records, modes)
    bad = set(same["differing"])
    rows = []
    for category in [*categories(records), ALL]:
        of_category = [r for r in records if category in (ALL, r.category)]
        differ = len({r.index for r in of_category if r.index in bad})
        for mode in modes:
            stats = group_stats([r for r in of_category if r.mode == mode])
            rows.append({"category": category, "mode": mode, **stats, "differ": differ})
    return {"modes": list(modes), "categories": categories(records), "rows": rows, "identical": same,
            "bands": bands(records, modes), "forced": forced(records), "repeat_spread": spread,
            "vs_plain_intervals": intervals,
            "route_retunes": dict(route_retunes) if route_retunes is not None else None,
            "stored_tasks": list(stored_tasks) if stored_tasks is not None else None,
            "clustering": clustering(records, stored_tasks)}


def row(report: Mapping[str, Any], category: str, mode: str) -> dict[str, Any]:
    """The report's row for ``category`` (or :data:`ALL`) in ``mode``."""
    for r in report["rows"]:
        if r["category"] == category and r["mode"] == mode:
            return r
    raise KeyError(f"no row for category {category!r} in mode {mode!r}")


def _route_text(r: Mapping[str, Any]) -> str:
    """The most common route, and how many others were taken (over the whole stream: how many routes)."""
    n = len(r["routes"])
    if r["category"] == ALL and n > 1:
        return f"{n} routes"
    return f"{r['route']}" + (f" (+{n - 1})" if n > 1 else "")


def _verdict(same: Mapping[str, Any]) -> str:
    if len(same["modes"]) < 2:
        return "outputs: one mode, nothing to compare"
    if not same["differ"]:
        return f"outputs: identical across {', '.join(same['modes'])} on all {same['requests']} requests"
    shown = ", ".join(map(str, same["differing"][:10])) + (" ..." if same["differ"] > 10 else "")
    return f"outputs: {same['differ']} of {same['requests']} requests DIFFER across modes (requests {shown})"


def format_table(report: Mapping[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    cfg = report.get("config") or {}
    title = "replay" + (f" {cfg['stream']} on {cfg['url']}" if cfg else "")
    table = Table(title=title, caption=_caption(report))
    for col in ("category", "mode", "requests", "tok/s", "after 1st", "acceptance", "M", "route", "switches",
                "tuning", "switched in request", "control cost", "differ"):
        table.add_column(col, justify="left" if col in ("category", "mode", "route") else "right")
    for r in report["rows"]:
        switched, cost = r.get("controller_switched"), r.get("controller_share")
        table.add_row(r["category"], r["mode"], str(r["requests"]), f"{r['tokens_per_s']:.2f}",
                      f"{r['after_first_tokens_per_s']:.2f}",
                      f"{r['acceptance']:.2f}", f"{r['mean_accepted']:.2f}", _route_text(r), str(r["switches"]),
                      str(r["tuning_requests"]), "-" if switched is None else f"{switched:.0%}",
                      "-" if cost is None else f"{cost:.2%}", str(r["differ"]),
                      end_section=r["mode"] == report["modes"][-1])
    console = Console(width=140, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def _caption(report: Mapping[str, Any]) -> str:
    lines = [_verdict(report["identical"])]
    retunes = report.get("route_retunes")
    if retunes is not None:
        per_route = ", ".join(f"{route} {n}" for route, n in sorted(retunes.items()) if n) or "none"
        lines.append(f"server re-tunes per route: {per_route}")
    for r in report.get("bands") or []:
        if r["mode"] != "plain" and r["vs_plain"] is not None:
            lines.append(f"{r['band']} tokens, {r['mode']}: {r['tokens_per_s']:.2f} tok/s, {r['vs_plain']:.2f}x plain "
                         f"({r['requests']} requests)")
    for band, f in (report.get("forced") or {}).items():
        ratio = f["latency_ratio"]
        lines.append(f"auto beside its choice forced, {band} tokens: latency ratio {ratio:.3f} over {f['pairs']} "
                     f"requests ({f['same_drafting']} drafted identically)" if ratio is not None else
                     f"auto beside its choice forced, {band} tokens: no latency measured")
    for mode, ratios in (report.get("repeat_spread") or {}).items():
        per_category = [v for c, v in ratios.items() if c != ALL]
        if per_category:
            lines.append(f"{mode}, second round / first (latency): {min(per_category):.3f}-{max(per_category):.3f} "
                         f"per category, {ratios[ALL]:.3f} over all")
    for mode, per in (report.get("vs_plain_intervals") or {}).items():
        cats = {c: v for c, v in per.items() if c != ALL}
        if cats:
            low = min(cats, key=lambda c: cats[c][0])
            lines.append(f"{mode} / plain, {INTERVAL_LEVEL:.0%} interval over requests: {per[ALL][0]:.3f}-{per[ALL][1]:.3f} "
                         f"over all; lowest category {low} {cats[low][0]:.3f}-{cats[low][1]:.3f}")
    cl = report.get("clustering")
    if cl:
        lines.append(f"pending clusters of unknown requests: adjusted Rand index {cl['ari']:.3f} against the "
                     f"categories ({cl['requests']} requests, {cl['categories']} categories, {cl['clusters']} clusters)")
        unseen = cl.get("unseen")
        if unseen:
            lines.append(f"  on the categories no stored task is named after: {unseen['ari']:.3f} ({unseen['requests']} "
                         f"requests, {unseen['categories']} categories, {unseen['clusters']} clusters)")
    return "\n".join(lines)


def write_json(report: Mapping[str, Any], records: Sequence[ReplayRecord], path: Path) -> Path:
    """The report and every record (token ids included) as one JSON file, replaced whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**report, "records": [r.as_dict() for r in records]}, indent=2))
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------- plot
PLOT_SIZE = (10.0, 4.0)  # inches
AXES_PX = 760  # about the axes' width in pixels at figure.DPI
LABEL_PX = 5.5  # about one character of a 7-point band label in pixels


def category_bands(records: Sequence[ReplayRecord]) -> list[tuple[str, int, int]]:
    """(category, first index, last index) of each run of consecutive requests of one category."""
    bands: list[tuple[str, int, int]] = []
    for index, category in sorted({(r.index, r.category) for r in records}):
        if bands and bands[-1][0] == category and bands[-1][2] == index - 1:
            bands[-1] = (category, bands[-1][1], index)
        else:
            bands.append((category, index, index))
    return bands


def replay_plot(records: Sequence[ReplayRecord], modes: Sequence[str], path: Path | str) -> Path:
    """Tok/s of each request over the stream, one line per mode, on shaded bands labelled by
    category (as SWIFT's figure 7 shows speed over a stream of changing tasks); a request sent in
    several rounds at its median (``combined``)."""
    from matplotlib import colormaps

    from autotune.reports.figure import new_figure, note, save_figure

    records = combined(records)
    fig, ax = new_figure(PLOT_SIZE)
    palette = colormaps["Pastel1"]
    shade = {c: palette(i % palette.N) for i, c in enumerate(categories(records))}
    bands = category_bands(records)
    span = max((stop for _, _, stop in bands), default=0) + 1
    for category, start, stop in bands:
        ax.axvspan(start - 0.5, stop + 0.5, color=shade[category], alpha=0.6, linewidth=0)
        narrow = len(category) * LABEL_PX > (stop - start + 1) / span * AXES_PX  # the label would spill over
        ax.text((start + stop) / 2, 0.98, category, transform=ax.get_xaxis_transform(), ha="center", va="top",
                rotation=90 if narrow else 0, fontsize=7, color="0.25")
    for mode in modes:
        points = sorted((r.index, r.tokens_per_s) for r in records if r.mode == mode)
        if points:
            ax.plot(*zip(*points), marker="o", markersize=2.5, linewidth=1.2, label=mode)
    ax.set_xlabel("request (stream order)")
    ax.set_ylabel("tok/s")
    top = max((r.tokens_per_s for r in records), default=0.0)
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)  # headroom for the band labels
    ax.grid(axis="y", alpha=0.3)
    if records:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="mode", title_fontsize=8)
        ax.set_title("tok/s per request over the stream", fontsize=10)
    else:
        note(ax, "no requests were replayed")
    return save_figure(fig, path)
