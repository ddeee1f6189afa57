"""``autotune profile``: what one step of each kind costs on this device, timed through our runtime's
forward (``runtime.transformer.CausalLM``): the cost model's own terms, measured.

- ``plain``: one single-token target forward over a prefix of ``context`` cached tokens (a round of
  plain decoding, and the unit of the cost coefficient c);
- ``verify``: one target forward over ``W`` rows after that prefix, logits for every row (the padded
  verify pass of ``runtime.decoding``), with the linear backend a decoder would use for width ``W``;
- ``draft``: one single-token forward of the drafting model (the draft, or the target itself when
  there is none) under a layer plan: none (every layer in order), and EasySpec's layer-parallel plan
  for each LP size.

c = draft step / plain target step (Leviathan et al. 3.3). Each step is timed by
``autotune.timing.time_blocked`` (``torch.utils.benchmark``'s blocked runs after one warm-up call),
which synchronises the accelerator before reading the clock, so CUDA timings are kernel time, not
launch time. The KV prefix
is zeros (timing only: its contents do not change the cost), as in ``autotune.tuning.cost_model``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autotune.errors import SettingError
from autotune.measure.profile_settings import ProfileSettings
from autotune.timing import time_blocked
from runtime.kv_cache import KVCache
from runtime.loading import LoadedModel, prepare_backend
from runtime.pipeline import ModelPool, verify_packing
from runtime.precision import PRECISIONS, get_precision
from runtime.transformer import CausalLM
from search_spaces import LayerPlan, easyspec_plan


@dataclass
class StepTime:
    """One step kind's timing: the median over blocks, in milliseconds."""

    kind: str  # plain | verify | draft
    model: str
    rows: int
    plan: str  # "none", or "lpN" (EasySpec layer-parallel size N)
    ms: float
    iqr_ms: float
    runs: int  # timed calls
    backend: str = "dense"  # linear backend of the projections
    groups: list[list[int]] = field(default_factory=list)  # the plan's layer-parallel groups
    c: float | None = None  # draft step / plain target step


def prefix_cache(lm: CausalLM, context: int, rows: int) -> KVCache:
    cache = lm.new_cache(context + rows + 1)
    cache.length = context
    return cache


def forward_step(
    lm: CausalLM, context: int, rows: int, plan: LayerPlan | None, all_logits: bool
) -> Callable[[], object]:
    """One forward of ``rows`` tokens after ``context`` cached ones; the cache is rewound each call."""
    cache = prefix_cache(lm, context, rows)
    ids = torch.zeros(rows, dtype=torch.long, device=lm.device)
    logits_for = None if all_logits else slice(-1, None)

    def step() -> torch.Tensor:
        cache.length = context
        with torch.inference_mode():
            return lm(ids, cache, plan=plan, logits_for=logits_for).float()

    return step


def _timed(
    kind: str, model: str, lm: CausalLM, rows: int, plan: LayerPlan | None, label: str, s: ProfileSettings
) -> StepTime:
    if s.compile and not lm.is_compiled:
        lm.compile_steps()
    step = forward_step(lm, s.context, rows, plan, all_logits=kind != "draft")
    timing = time_blocked(step, s.min_run_time)
    groups = [list(g) for g in plan.groups] if plan is not None else []
    return StepTime(kind, model, rows, label, 1e3 * timing.median, 1e3 * timing.iqr, timing.calls, lm.backend, groups)


def served_lm(model: LoadedModel, draft: bool = False, compiled: bool = False) -> CausalLM:
    """``model`` as a plain step runs it: its precision's linear backend (float32 on the CPU:
    oneDNN's, ``Precision.backend_on``; other float ones dense);
    ``draft``: as a draft model drafts (its draft head, ``runtime.pipeline.ModelPool.draft_wrapper``)."""
    lm = CausalLM(model.hf_model)
    precision = PRECISIONS[model.precision]
    backend = precision.backend if draft else precision.backend_on(lm.device, compiled)
    if backend != "dense":
        prepare_backend(model, backend)
        lm.use_linear_backend(backend, draft=draft)
    return lm


def verify_lm(target: LoadedModel, width: int, compiled: bool = False, served: CausalLM | None = None) -> CausalLM:
    """The target as a decoder verifying ``width`` rows runs it (``runtime.pipeline.build_decoder``):
    a quantised precision's (or oneDNN's float32) one kernel family at every width; float32 weights packed for the width on
    CPU (unless compiled); the model's own weights elsewhere."""
    if PRECISIONS[target.precision].backend_on(target.hf_model.device, compiled) != "dense":  # one kernel family, every width
        return served if served is not None else served_lm(target, compiled=compiled)
    lm = CausalLM(target.hf_model)
    backend = verify_packing(lm, str(lm.device), compiled)
    if width > 1 and backend is not None:
        lm.use_linear_backend(backend, width)
    return lm


def profile_target(target: LoadedModel, s: ProfileSettings) -> tuple[StepTime, list[StepTime]]:
    """The plain step and the verify step at every width (one packed copy of the weights at a time)."""
    served = served_lm(target, compiled=s.compile)
    plain = _timed("plain", target.name, served, 1, None, "none", s)
    verify = [_timed("verify", target.name, verify_lm(target, w, s.compile, served), w, None, "none", s)
              for w in sorted(set(s.widths))]
    return plain, verify


def draft_plans(n_layers: int, lp_sizes: tuple[int, ...]) -> list[tuple[str, LayerPlan | None]]:
    return [("none", None)] + [(f"lp{lp}", easyspec_plan(n_layers, lp)) for lp in sorted(set(lp_sizes))]


def profile_draft(
    drafting: LoadedModel, plain_ms: float, s: ProfileSettings, own_model: bool = True
) -> list[StepTime]:
    """The draft step under each plan, with c = its time / the plain target step; ``own_model``:
    a draft model (its draft head), else the target drafting itself (layer skipping)."""
    lm = served_lm(drafting, draft=own_model)
    out = []
    for label, plan in draft_plans(lm.dims.n_layers, s.lp_sizes):
        row = _timed("draft", drafting.name, lm, 1, plan, label, s)
        row.c = row.ms / plain_ms
        out.append(row)
    return out


def run_profile(
    model: str, draft: str | None, device: str, precision: str, random_weights: bool, s: ProfileSettings,
    pool: ModelPool | None = None,
) -> dict[str, Any]:
    """Load (or build) the models at ``precision``, time every step kind, return the report.
    ``pool``: reuse its loaded module trees (several precisions of one model load it once)."""
    check_device(device)
    prec = get_precision(precision, device, s.compile)
    pool = pool or ModelPool(device=device, random_weights=random_weights)
    target = pool.get(model, prec.name)
    plain, verify = profile_target(target, s)
    drafting = pool.get(draft, prec.name) if draft else target
    drafts = profile_draft(drafting, plain.ms, s, own_model=bool(draft))
    return {
        "config": {
            "model": target.model_id, "draft": drafting.model_id if draft else None, "device": device,
            "dtype": prec.name, "precision": prec.name, "random_weights": random_weights,
            "context": s.context, "widths": sorted(set(s.widths)), "lp_sizes": sorted(set(s.lp_sizes)),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "device_name": device_name(device),
            "compile": s.compile,
        },
        "plain": asdict(plain),
        "verify": [asdict(v) for v in verify],
        "draft": [asdict(d) for d in drafts],
    }


def check_device(device: str) -> None:
    """A device this machine cannot use is one clear error, before any model is built."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SettingError(f"unknown --device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(f"--device {device}: no CUDA device is available here; use --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise SettingError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")


def device_name(device: str) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type


def format_table(report: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"profile: {cfg['dtype']} on {cfg['device_name']}, {cfg['context']} cached tokens"
                  + (", random weights" if cfg["random_weights"] else "")
                  + (", compiled steps" if cfg.get("compile") else ""))
    for col in ("step", "model", "rows", "plan", "ms/step", "iqr ms", "x plain", "backend"):
        table.add_column(col, justify="left" if col in ("step", "model", "plan", "backend") else "right")
    plain_ms = report["plain"]["ms"]
    for row in [report["plain"], *report["verify"], *report["draft"]]:
        ratio = row["c"] if row["c"] is not None else row["ms"] / plain_ms
        table.add_row(
            row["kind"], row["model"], str(row["rows"]), row["plan"], f"{row['ms']:.2f}", f"{row['iqr_ms']:.2f}",
            f"{ratio:.2f}" + (" (c)" if row["kind"] == "draft" else ""), row["backend"],
        )
    console = Console(width=120, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def format_comparison(reports: list[dict[str, Any]]) -> str:
    """The target's step by rows at each precision, in ms and as a ratio to the first precision's."""
    from rich.console import Console
    from rich.table import Table

    base = reports[0]
    table = Table(title=f"target step by rows: ms (x {base['config']['precision']}) at each precision")
    table.add_column("rows", justify="right")
    for r in reports:
        table.add_column(r["config"]["precision"], justify="right")
    for i, row in enumerate([base["plain"], *base["verify"]]):
        cells = []
        for r in reports:
            ms = [r["plain"], *r["verify"]][i]["ms"]
            cells.append(f"{ms:.2f} ({row['ms'] / ms:.2f}x)")
        table.add_row(f"{row['rows']}" + (" plain" if i == 0 else ""), *cells)
    console = Console(width=160, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()
