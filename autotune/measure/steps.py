"""The vLLM batch schedule of a stored strategy, from batched forwards timed now
(``autotune.tuning.steps``; ``autotune.tuning.load``)."""
from __future__ import annotations

from autotune.tuning.steps import PROFILE_CONTEXT, batch_sizes, choose_row_ways, step_shapes, time_steps

__all__ = ["PROFILE_CONTEXT", "batch_sizes", "choose_row_ways", "step_shapes", "time_steps", "vllm_batch_schedule"]


def vllm_batch_schedule(stored: object, device: str = "cpu") -> dict[str, int]:
    """The batch schedule of a stored strategy (``autotune.tuning.load.batch_schedule``), from
    step costs timed now, on this machine, with random weights of the stored model's shape (the
    stored acceptance; a draft model's depth timed at each batch size, prompt lookup free). It
    only transfers to the hardware the strategy was tuned on, so any other machine is refused."""
    from autotune.errors import ExportError
    from autotune.store.hardware import hardware_fingerprint
    from autotune.tuning.load import DEFAULT_ACCEPTANCE, SCHEDULE_BATCHES, StepCost, batch_schedule, strategy_rows
    from runtime.pipeline import ModelPool, verify_packing
    from runtime.precision import draft_precision

    key, strategy = stored.key, stored.strategy  # type: ignore[attr-defined]
    here = hardware_fingerprint(device)
    if key.hardware != here:
        raise ExportError(f"strategy {stored.id} was tuned on '{key.hardware}' and this machine is '{here}': a batch "  # type: ignore[attr-defined]
                          "schedule only transfers to the hardware it was measured on; export it there")
    if not strategy.speculates:
        raise ExportError(f"strategy {stored.id} is plain decoding: there is no draft length to schedule")  # type: ignore[attr-defined]
    name, _, rest = key.model_id.partition("@")
    precision = rest.partition("#")[2] or "float32"
    pool = ModelPool(device=device, random_weights=True)
    target = pool.get(name, precision)
    lm = pool.served(target)
    width = strategy.max_tree_nodes + 1
    backend = verify_packing(lm, device)
    if backend is not None:
        lm = pool.target_for_width(target, backend, width)
    biggest = max(SCHEDULE_BATCHES)
    choose_row_ways(lm, biggest * (1 + strategy.draft_length))
    cost = StepCost(time_steps(lm, step_shapes(biggest, (0, strategy.draft_length))))
    if strategy.drafter == "draft-model":
        prec = draft_precision(strategy.draft_precision, device)
        draft = pool.draft_wrapper(pool.get(key.draft_id, prec.name), prec.backend, strategy.draft_vocab, lm.dims.vocab)
        timed = {s: t for _, s, t in time_steps(draft, [(b, b) for b in SCHEDULE_BATCHES])}
        draft_step = timed.__getitem__
    else:  # prompt lookup: host-side copies (what vLLM exports besides a draft model)
        draft_step = lambda b: 0.0  # noqa: E731
    acceptance = stored.acceptance if stored.acceptance is not None else DEFAULT_ACCEPTANCE  # type: ignore[attr-defined]
    return batch_schedule(acceptance, strategy.draft_length, cost, draft_step, strategy_rows(strategy))
