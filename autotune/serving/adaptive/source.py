"""What adaptive serving needs of the decode worker: its decoders at the one verify width, and the
controllers' measured cost model where per-request control is on."""
from __future__ import annotations

from typing import Protocol

from autotune.tuning.cost_model import MeasuredCostModel
from runtime.decoding import Decoder
from search_spaces.strategy import Strategy


class DecoderSource(Protocol):
    """The worker's side of a re-tune (``serving.worker.SharedDecoders``)."""

    @property
    def verify_width(self) -> int:
        """The verify width every speculative decoder of the worker packs its target for."""
        ...

    def decoder(self, strategy: Strategy) -> Decoder:
        """The worker's kept decoder of ``strategy`` (its result checks decode with it)."""
        ...

    def note_width(self, width: int) -> None:
        """A decoder was built at ``width`` outside the worker (``/metrics`` counts widths)."""
        ...

    def shared_cost(self, decoder: Decoder) -> MeasuredCostModel | None:
        """The controllers' cost model for ``decoder``'s drafting model; None: control is off."""
        ...
