"""Run `autotune study` with every timed forward of the cost model's one-time calibration printed
(model, rows, plan kind, seconds) to stderr: where the calibration part of the tuning share goes.

    AUTOTUNE_DATA_DIR=../shared/data python tools/trace_cost_timing.py study --model qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --task humaneval --limit 10 --max-new-tokens 64 --storage sqlite:////tmp/t.db
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.cli.main import main  # noqa: E402
from autotune.tuning import cost_model  # noqa: E402

_real = cost_model.MeasuredCostModel._forward_s


def _traced(self, lm, rows, plan, **kwargs):  # type: ignore[no-untyped-def]
    """``_forward_s`` with its arguments passed through (a new keyword does not break the trace)."""
    t0 = time.perf_counter()
    out = _real(self, lm, rows, plan, **kwargs)
    best_of = kwargs.get("best_of", 1)
    kind = "full" if plan is None else ("groups" if plan.groups else "skips")
    who = "target" if lm is self.target else "draft"
    print(f"timed {who} rows={rows} context={self.context} plan={kind} best_of={best_of} {time.perf_counter() - t0:.3f} s"
          f" (kept {out:.3f} s)",
          file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    cost_model.MeasuredCostModel._forward_s = _traced
    sys.exit(main(sys.argv[1:]))
