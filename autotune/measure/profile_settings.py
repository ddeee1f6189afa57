"""What ``autotune profile`` times and for how long (validated, frozen); apart from the timing code so
the command line reads its defaults without loading the timer."""
from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import SettingError

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_LP_SIZES = (2, 3, 4)


@dataclass(frozen=True)
class ProfileSettings:
    widths: tuple[int, ...] = DEFAULT_WIDTHS  # verify rows to time
    lp_sizes: tuple[int, ...] = DEFAULT_LP_SIZES  # EasySpec layer-parallel sizes for the draft step
    context: int = 256  # tokens already in the KV cache before each timed step
    min_run_time: float = 0.5  # seconds of timing per step (blocked_autorange)
    seed: int = 0  # random weights (--random-weights)
    compile: bool = False  # time compiled steps (runtime.compiled; the first call compiles, untimed)

    def __post_init__(self) -> None:
        if not self.widths or any(w < 1 for w in self.widths):
            raise SettingError(f"--widths must be positive row counts like 1,2,4,8, got {list(self.widths)}")
        if any(lp < 2 for lp in self.lp_sizes):
            raise SettingError(f"--lp-size values must be at least 2 (layer-parallel groups), got {list(self.lp_sizes)}")
        if not self.min_run_time > 0:
            raise SettingError(f"--min-time must be a positive number of seconds, got {self.min_run_time}")
        if self.context < 1:
            raise ValueError(f"context must be at least 1 token, got {self.context}")
