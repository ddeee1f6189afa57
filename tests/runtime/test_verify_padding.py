"""A decoder pads its verify pass to the fixed width only where that buys something (a target packed
for the width, or compiled for static shapes); otherwise a verify runs its drafted rows alone, since
a quantised target's verify costs grow with every row. Either way the output is plain decoding's."""
from __future__ import annotations

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.lookup import PromptLookupDrafter
from runtime.testing import tiny_model
from runtime.transformer import CausalLM

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]  # recurs: prompt lookup drafts from the start


class RowSpy(CausalLM):
    """The target, recording the rows of every forward after the prefill."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.rows: list[int] = []

    def __call__(self, tokens, *args, **kwargs):  # type: ignore[override]
        self.rows.append(int(tokens.shape[0]))
        return super().forward(tokens, *args, **kwargs)


@pytest.mark.parametrize("pads", [True, False])
def test_verify_rows_follow_padding(pads):
    model = tiny_model("llama", 0)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = Decoder(CausalLM(model)).generate(PROMPT, cfg).tokens
    spy = RowSpy(model)
    decoder = Decoder(spy, PromptLookupDrafter(), 8, verify_width=9, kind="prompt-lookup")
    decoder.pads = pads
    out = decoder.generate(PROMPT, cfg)
    assert out.tokens == plain
    assert out.stats.drafted > 0  # it speculated
    verifies = spy.rows[1:]  # after the prefill
    drafted_rounds = [r for r in verifies if r > 1]
    assert drafted_rounds
    if pads:
        assert set(drafted_rounds) == {9}
    else:  # 1 + what was drafted, never padding
        assert max(drafted_rounds) <= 9 and sum(r - 1 for r in drafted_rounds) == out.stats.drafted
        assert min(drafted_rounds) < 9  # a round that drafted fewer than 8 ran fewer rows (power)
    # the stats count each round by the rows it verified before padding (what re-pricing needs)
    counted = [r for r, n in enumerate(out.stats.verify_rows) for _ in range(n)]
    assert len(counted) == len(verifies) and sum(counted) - len(counted) == out.stats.drafted
    if not pads:
        assert sorted(counted) == sorted(verifies)
