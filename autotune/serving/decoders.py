"""The decode worker's decoders: one per strategy (least recently used out), spares for batch-mates of
the same strategy, the one verify width they share, and the target wrapper batched steps run."""
from __future__ import annotations

import logging
from collections import OrderedDict
from weakref import WeakKeyDictionary

from autotune.tuning.controller import ControlSettings, lookup_candidate
from runtime.decoding import Decoder
from runtime.errors import RuntimeUserError
from runtime.pipeline import ModelPool, build_decoder, verify_packing
from runtime.prefix_cache import PrefixCache
from runtime.slots import SlotCache
from runtime.transformer import CausalLM
from search_spaces.strategy import Strategy

log = logging.getLogger("autotune.serve")


class DecoderCache:
    """Decoders built from the shared ``ModelPool`` (the weights once), one per running request of a
    strategy. One verify width for every speculative strategy: one packed copy of the target's
    weights, fixed once serving starts (``freeze_width``)."""

    def __init__(self, pool: ModelPool, target: object, draft: str | None, control: ControlSettings | None,
                 max_decoders: int, max_spares: int, prefix: PrefixCache | None = None) -> None:
        self.pool, self.target, self.draft = pool, target, draft
        self.control = control  # what the decoders keep on standby for their controllers (None: nothing)
        self.max_decoders, self.max_spares = max_decoders, max_spares
        self.decoders: OrderedDict[Strategy, Decoder] = OrderedDict()
        self.verify_width = 0
        self.width_frozen = False
        self.widths: set[int] = set()  # the verify widths this worker's decoders were built for
        self.unservable: dict[Strategy, str] = {}  # strategies it cannot run, and why
        self._in_use: set[int] = set()  # ids of the decoders serving a running request
        self._spare: dict[Strategy, list[Decoder]] = {}  # more decoders per strategy, for batch-mates
        self._batch_target: tuple[int, CausalLM] | None = None  # (verify width, the wrapper batched steps run)
        # under serve --compile with batching: the K/V slots of the running sequences, so that a batched
        # step is one static-shape forward (``runtime.slots``; ``startup.use_slots``)
        self.slots: SlotCache | None = None
        # K/V rows kept across requests, every decoder's prompts read and its finished sequences fill (None: off)
        self.prefix = prefix
        self._resets = 0  # cache resets so far (``reset_rows``); each decoder forgets its rows once per reset
        self._forgot: WeakKeyDictionary[Decoder, int] = WeakKeyDictionary()  # a decoder -> the resets it caught up with

    def __len__(self) -> int:
        """Decoders kept (one per strategy, and spares for batch-mates of the same strategy)."""
        return len(self.decoders) + sum(len(v) for v in self._spare.values())

    def share_width(self, strategies: list[Strategy], at_least: int = 0) -> None:
        """Pad every speculative strategy's verify pass to the widest of ``strategies`` and
        ``at_least`` (at start-up, before ``freeze_width``)."""
        if self.width_frozen:
            raise RuntimeError("the verify width is fixed once the server serves")
        self.verify_width = max([self.verify_width] + [s.max_tree_nodes + 1 for s in strategies if s.speculates])
        self.verify_width = max(self.verify_width, at_least)

    def freeze_width(self) -> None:
        """From now on no strategy widens the verify pass: one packed copy of the target serves
        them all (a wider one stored later decodes plainly until a restart; ``servable``)."""
        self.width_frozen = True

    def note_width(self, width: int) -> None:
        """A decoder was built elsewhere (a re-tune's) at ``width``: ``/metrics`` counts it."""
        self.widths.add(width)

    def use_slots(self, slots: SlotCache) -> None:
        """Running sequences keep their K/V in ``slots`` from now on (at start-up)."""
        self.slots = slots

    def servable(self, strategy: Strategy) -> str | None:
        """Why this server cannot decode ``strategy`` now (it then decodes plainly), or None."""
        if strategy in self.decoders or not strategy.speculates:
            return None
        if strategy in self.unservable:
            return self.unservable[strategy]
        why = None
        if self.width_frozen and self.verify_width and strategy.max_tree_nodes + 1 > self.verify_width:
            why = (f"it verifies {strategy.max_tree_nodes + 1} tokens a round and this server packed its target "
                   f"for {self.verify_width}; restart the server to serve it")
        else:
            try:
                self.decoder(strategy)
            except RuntimeUserError as exc:  # e.g. an int8 draft under --compile
                why = str(exc)
        if why is not None:
            self.unservable[strategy] = why
            log.warning("stored strategy %s cannot run on this server (%s); its requests decode plainly",
                        strategy.to_json(), why)
        return why

    def decoder(self, strategy: Strategy) -> Decoder:
        """The kept decoder of ``strategy`` (built now where there is none)."""
        dec = self.decoders.get(strategy)
        if dec is None:
            width = None
            if strategy.speculates:
                width = max(self.verify_width, strategy.max_tree_nodes + 1)
                if self.width_frozen and self.verify_width and width > self.verify_width:
                    raise RuntimeUserError(f"verify width {width} is wider than this server's {self.verify_width}")
                self.verify_width = width  # the first speculative strategy of a server without one fixes it
            standby = self._standby(strategy, width)
            if standby and width is None:
                width = self.verify_width
            dec = build_decoder(self.pool, self.target, strategy, self._draft_for(strategy),
                                verify_width=width, standby=standby)
            if width is not None:
                self.widths.add(width)
            self.decoders[strategy] = dec
            while len(self.decoders) > self.max_decoders:
                self.decoders.popitem(last=False)
        self.decoders.move_to_end(strategy)
        return dec

    def acquire(self, strategy: Strategy) -> Decoder:
        """A decoder of ``strategy`` that serves no running request (a batch-mate of the same
        strategy gets another one, built from the pool's shared weights)."""
        dec = self.decoder(strategy)
        if id(dec) in self._in_use:
            spare = self._spare.setdefault(strategy, [])
            if spare:
                dec = spare.pop()
            else:
                width = dec.verify_width if strategy.speculates or dec.standby else None
                standby = self._standby(strategy, width)
                dec = build_decoder(self.pool, self.target, strategy, self._draft_for(strategy),
                                    verify_width=width, standby=standby)
        self._in_use.add(id(dec))
        if self._forgot.get(dec, 0) != self._resets:
            dec.forget_rows()
            self._forgot[dec] = self._resets
        dec.target.slots = self.slots
        dec.prefix = self.prefix
        return dec

    def release(self, strategy: Strategy, dec: Decoder) -> None:
        """``dec`` (acquired for ``strategy``) serves no request any more: kept for the next one."""
        self._in_use.discard(id(dec))
        if self.slots is not None:
            self.slots.give_back(dec)
        dec.step_cap = dec.step_width = None  # a batch's draft for its last request is not the next one's
        dec.apply(strategy)  # its controller may have switched it: the next request starts from its key
        if self.decoders.get(strategy) is not dec:
            spare = self._spare.setdefault(strategy, [])
            if len(spare) < self.max_spares and strategy in self.decoders:
                spare.append(dec)
        for gone in [s for s in self._spare if s not in self.decoders]:  # its primary was evicted
            del self._spare[gone]

    def reset_rows(self) -> int:
        """Keep no K/V rows of the requests served so far: the prefix cache is emptied now and each
        decoder forgets its drafting models' kept rows before its next request (safe from any thread:
        the worker reads the reset count as it acquires a decoder; a running request keeps its own
        rows) -> the bytes the prefix cache freed."""
        freed = 0
        if self.prefix is not None:
            freed = self.prefix.stats.used_bytes
            self.prefix.clear()
        self._resets += 1
        return freed

    def batch_target(self) -> CausalLM:
        """The target wrapper batched steps run: on CPU in float32, the packed copy at the verify
        width (verify rows are then computed as a solo verify computes them); else the served one."""
        if self._batch_target is None or self._batch_target[0] != self.verify_width:
            lm = self.pool.served(self.target)
            backend = verify_packing(lm, self.pool.device, self.pool.compile)
            if backend is not None and self.verify_width > 1:
                lm = self.pool.target_for_width(self.target, backend, self.verify_width)
            if self.pool.compile and not lm.is_compiled:
                lm.compile_steps()
            self._batch_target = (self.verify_width, lm)
        return self._batch_target[1]

    def _standby(self, strategy: Strategy, width: int | None) -> list[Strategy]:
        """Drafters a decoder of ``strategy`` keeps following the sequence for its controller:
        prompt lookup (no forward, a dict of n-grams), where the verify width leaves it room (not
        the server's default draft chain: letting every request reach it lost more than it won)."""
        if self.control is None or strategy.drafter == "prompt-lookup":
            return []
        look = lookup_candidate(self.control.lookup_length, width or self.verify_width)
        return [look] if look is not None else []

    def _draft_for(self, strategy: Strategy) -> str | None:
        return self.draft if strategy.drafter == "draft-model" else None
