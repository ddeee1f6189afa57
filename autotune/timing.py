"""Every duration the project measures goes through here: repeated calls of a step
(``time_calls``: synchronised clock reads, the cost model's and the server's step tables),
``torch.utils.benchmark``'s blocked runs (``time_blocked``: ``autotune profile``), and the wall time
of a block of work (``Stopwatch``: a re-tune's decoding, start-up phases)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import torch
from torch.utils.benchmark import Timer


def sync_device(device: torch.device | str) -> None:
    """Wait for the device's queued kernels (on CUDA a forward returns once its kernels are launched)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Seconds per call: one sample per timed call (``time_calls``) or per block (``time_blocked``)."""

    samples: tuple[float, ...]
    calls: int  # calls timed in all

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        """The least sample: noise only ever adds time."""
        return min(self.samples)

    @property
    def iqr(self) -> float:
        """Interquartile range of the samples (0 for fewer than two)."""
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q3 - q1


def time_calls(
    fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu", warm: bool = True,
    setup: Callable[[], object] | None = None,
) -> Timing:
    """``repeats`` timed calls of ``fn`` (after one untimed call with ``warm``), each between two
    device synchronisations; ``setup`` runs untimed before every call (rewinding a cache)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    if warm:
        if setup is not None:
            setup()
        fn()
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        sync_device(device)
        started = time.perf_counter()
        fn()
        sync_device(device)
        samples.append(time.perf_counter() - started)
    return Timing(tuple(samples), repeats)


def time_blocked(fn: Callable[[], object], min_run_time: float, min_blocks: int = 3) -> Timing:
    """``fn`` after one warm-up call, in blocks of calls for at least ``min_run_time`` seconds and
    at least ``min_blocks`` blocks (``torch.utils.benchmark.Timer.blocked_autorange``, which
    synchronises an accelerator before reading the clock); one sample per block."""
    fn()  # warm: lazily built state (stacked group weights, RoPE tables, allocator) stays out
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    measured = timer.blocked_autorange(min_run_time=min_run_time)
    per_call = list(measured.times)  # seconds per call, one entry per block
    while len(per_call) < min_blocks:
        per_call.extend(timer.timeit(measured.number_per_run).times)
    return Timing(tuple(per_call), measured.number_per_run * len(per_call))


class Stopwatch:
    """Wall seconds of the blocks run under it, summed: ``with watch: ...`` adds one block's."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: float | None = None

    def __enter__(self) -> "Stopwatch":
        self._started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        assert self._started is not None, "a Stopwatch block exits only after it entered"
        self.seconds += time.perf_counter() - self._started
        self._started = None
