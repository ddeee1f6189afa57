"""Continuous batching is lossless: a sequence decoded in a batch, beside sequences of other
strategies that join and leave, returns exactly what it returns decoded alone (greedy); the batched
step's host reads are counted in ``tests/runtime/test_host_reads.py``."""
from __future__ import annotations

import pytest
import torch

from runtime.batching import BatchRequest, generate_batch
from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.linear import MklPackedLinear, mkl_packing_available, row_way, run_rows
from runtime.sampling import SamplingParams
from runtime.slots import ROW_BUCKETS, SlotCache, row_bucket
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan
from tests.runtime.batch_cases import PROMPTS, decoders as _decoders


@pytest.mark.parametrize("backend", ["dense", "int4"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_batch_decodes_each_sequence_as_it_decodes_alone(backend, sampling, monkeypatch):
    """Five strategies, five prompts of different lengths, joining at steps 0-4: every sequence's
    tokens (sampled ones too: each keeps its own generator) equal its solo decode; the chain and
    the tree, which share a draft model, draft in one batched forward per depth."""
    if backend == "int4" and not torch.backends.mkldnn.is_available():
        pytest.skip("no int4 CPU kernel in this torch build")
    params = SamplingParams() if sampling == "greedy" else SamplingParams(temperature=0.8, top_k=40)
    builders = _decoders(backend)
    configs = [GenerationConfig(max_new_tokens=24 + 4 * i, sampling=params, seed=i) for i in range(len(builders))]
    alone = [build().generate(p, c) for build, p, c in zip(builders.values(), PROMPTS, configs)]
    requests = [BatchRequest(build(), p, c, joins_at=i)
                for i, (build, p, c) in enumerate(zip(builders.values(), PROMPTS, configs))]
    draft_model = requests[1].decoder.drafter.model.hf_model
    batched_drafts = []
    real = CausalLM.forward_batch

    def spy(self, parts, plan=None):
        if self.hf_model is draft_model:
            batched_drafts.append(len(parts))
        return real(self, parts, plan)

    monkeypatch.setattr(CausalLM, "forward_batch", spy)
    together = generate_batch(requests[0].decoder.target, requests)
    assert batched_drafts and max(batched_drafts) == 2, batched_drafts  # the chain and the tree drafted together
    for name, a, b in zip(builders, alone, together):
        assert b.tokens == a.tokens, name
        assert b.stats.drafted == a.stats.drafted, name
    assert sum(r.stats.drafted for r in together) > 0
    assert max(max(r.stats.accept_hist[2:] or [0]) for r in together) > 0  # depth >= 2 accepted in the batch


def test_a_batch_that_mixes_up_its_rows_is_caught(monkeypatch):
    """Power check: logits handed to the wrong sequence change its output."""
    builders = _decoders()
    configs = [GenerationConfig(max_new_tokens=24) for _ in builders]
    alone = [build().generate(p, c) for build, p, c in zip(builders.values(), PROMPTS, configs)]
    real = CausalLM.forward_batch

    def first_row_of_the_next(self, parts, plan=None):  # each sequence's first row comes from its batch-mate
        out = real(self, parts, plan)
        return [torch.cat([out[(i + 1) % len(out)][:1], o[1:]]) for i, o in enumerate(out)]

    monkeypatch.setattr(CausalLM, "forward_batch", first_row_of_the_next)
    requests = [BatchRequest(build(), p, c) for build, p, c in zip(builders.values(), PROMPTS, configs)]
    together = generate_batch(requests[0].decoder.target, requests)
    assert any(b.tokens != a.tokens for a, b in zip(alone, together))


def test_each_request_needs_its_own_decoder():
    dec = Decoder(CausalLM(tiny_model("llama", 0)))
    with pytest.raises(ValueError, match="its own decoder"):
        generate_batch(dec.target, [BatchRequest(dec, [1, 2], GenerationConfig(8))] * 2)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_drafters_sharing_a_layer_plan_draft_together(sampling, monkeypatch):
    """Two self-drafters skipping the same layers of the shared target, and two EasySpec drafters
    (one draft model, one layer-parallel group) in one batch: each pair drafts in one forward per
    depth under its plan, and every sequence decodes as it decodes alone."""
    params = SamplingParams() if sampling == "greedy" else SamplingParams(temperature=0.8, top_k=40)
    model = tiny_model("qwen2", 21, layers=4)
    shared_draft = CausalLM(noisy_copy(model, 0.3, seed=2))
    target = CausalLM(model)
    skip = LayerPlan(n_layers=4, skip_mlp=(2,), skip_attn=(1,))
    group = LayerPlan(n_layers=4, groups=((1, 3),))

    def self_draft() -> Decoder:
        return Decoder(target, SelfDrafter(target, skip, TreeShape((1, 1, 1))), 3, verify_width=4)

    def easyspec() -> Decoder:
        lm = CausalLM(shared_draft.hf_model)
        lm.share_linears_from(shared_draft)
        return Decoder(target, ModelDrafter(lm, target.dims.vocab, TreeShape((2, 1)), plan=group), 2, verify_width=4)

    builders = [self_draft, easyspec, self_draft, easyspec]
    configs = [GenerationConfig(max_new_tokens=20 + 3 * i, sampling=params, seed=i) for i in range(4)]
    alone = [build().generate(p, c) for build, p, c in zip(builders, PROMPTS, configs)]
    planned: list[tuple[LayerPlan, int]] = []
    real = CausalLM.forward_batch

    def spy(self, parts, plan=None):
        if plan is not None:
            planned.append((plan, len(parts)))
        return real(self, parts, plan)

    monkeypatch.setattr(CausalLM, "forward_batch", spy)
    together = generate_batch(target, [BatchRequest(b(), p, c) for b, p, c in zip(builders, PROMPTS, configs)])
    assert {plan for plan, n in planned if n == 2} == {skip, group}, planned
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.tokens == a.tokens, i
        assert b.stats.drafted == a.stats.drafted > 0, i
    assert max(max(r.stats.accept_hist[2:] or [0]) for r in together) > 0


@pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL packed GEMM")
def test_batched_rows_run_in_packed_calls_or_one_dense_gemm():
    """Packed calls keep every row bit-identical to a call of exactly the packed width (a solo
    verify); the dense way computes the same product (to rounding); the way timed for the nearest
    row count at or above is used."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(19, 64)
    lin = MklPackedLinear(weight, None, 8)
    chunks, dense = run_rows(lin, x, "packed"), run_rows(lin, x, "dense")
    for i in range(19):
        alone = lin(torch.cat([x[i : i + 1], torch.zeros(7, 64)]))[0]  # the row in a call of width 8
        assert torch.equal(chunks[i], alone)
    torch.testing.assert_close(dense, x @ weight.T, rtol=1e-5, atol=1e-5)
    assert run_rows(lin, x[:1], "dense").shape == (1, 96) and run_rows(lin, x[:5], "dense").shape == (5, 96)
    ways = {2: "dense", 8: "packed", 16: "dense"}
    assert [row_way(ways, r) for r in (2, 3, 8, 9, 16, 40)] == ["dense", "packed", "packed", "dense", "dense", "dense"]
    assert row_way({}, 5) == "packed"


def _pending_at_first_round(dec: Decoder) -> list[int]:
    """Records what the drafter of ``dec`` has still to catch up on when its first round drafts."""
    drafter, seen = dec.drafter, []
    real = drafter.propose_steps

    def propose_steps(*args, **kwargs):
        if not seen:
            seen.append(len(drafter.pending))
        return real(*args, **kwargs)

    drafter.propose_steps = propose_steps
    return seen


def test_a_draft_models_prompt_catch_up_is_prefill_in_a_batch_too():
    """A joining sequence's draft model catches up on the prompt when it joins, timed as its
    prefill (as ``Decoder.generate`` does), never inside its first round: counted there, it made a
    GSM8K request's controller measure its draft chain slower than plain over its first window and
    stop it for the rest of the request (the server's decode path runs these same pieces)."""
    dec = _decoders()["chain"]()
    at_first_round = _pending_at_first_round(dec)
    (result,) = generate_batch(dec.target, [BatchRequest(dec, PROMPTS[0], GenerationConfig(max_new_tokens=8))])
    assert result.stats.drafted > 0
    assert at_first_round == [1]  # the prompt was caught up before the first round: only the newest token waits
    alone = _decoders()["chain"]()
    alone_at_first_round = _pending_at_first_round(alone)
    alone.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8))
    assert alone_at_first_round == [1]  # what generate does, which the batch now matches


def test_slot_cache_hands_each_holder_one_slot():
    lm = CausalLM(tiny_model("llama", 0))
    slots = SlotCache(lm, 2, 32, scratch=8)
    a, b = object(), object()
    va = slots.take(a, 20)
    assert va is not None and va.capacity == 32 and va.offset == 0
    assert slots.take(a, 20).offset == 0  # its own slot again, emptied
    assert slots.take(b, 33) is None  # does not fit a slot
    assert slots.take(b, 32).offset == 32 and slots.free == 0
    assert slots.take(object(), 8) is None  # none free
    slots.give_back(a)
    assert slots.free == 1
    d = lm.dims
    assert slots.bytes_per_slot == 2 * 4 * d.n_layers * d.n_kv_heads * d.head_dim * 32
    assert [row_bucket(r) for r in (1, 3, 16, 17, 128, 129)] == [1, 4, 16, 32, 128, 256]


def test_compiled_slot_steps_decode_each_sequence_as_alone(monkeypatch):
    """A compiled target (``fullgraph=True``: a graph break is an error) whose sequences keep their
    K/V in one ``SlotCache`` runs each batched step as one static-shape forward over the slots:
    plain, a chain and lookup decoded together equal their compiled solo decodes, no graph broke,
    and the batched steps ran at padded row buckets only."""
    from torch._dynamo.utils import counters

    import runtime.step_runner as step_runner

    builders = _decoders()
    names = ["plain", "chain", "lookup"]
    configs = [GenerationConfig(max_new_tokens=16) for _ in names]

    def compiled(name: str) -> Decoder:
        dec = builders[name]()
        dec.target.compile_steps()
        return dec

    alone = [compiled(n).generate(p, c) for n, p, c in zip(names, PROMPTS, configs)]
    decoders = [compiled(n) for n in names]
    slots = SlotCache(decoders[0].target, len(names), 64)
    for dec in decoders:
        dec.target.slots = slots
    buckets = []
    real = step_runner.slot_step

    def spy(lm, cache, parts):
        buckets.append(row_bucket(sum(int(p.tokens.shape[0]) for p in parts)))
        return real(lm, cache, parts)

    monkeypatch.setattr(step_runner, "slot_step", spy)
    counters.clear()
    together = generate_batch(decoders[0].target, [BatchRequest(d, p, c) for d, p, c in zip(decoders, PROMPTS, configs)])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert buckets and set(buckets) <= set(ROW_BUCKETS), buckets
    for name, a, b in zip(names, alone, together):
        assert b.tokens == a.tokens, name
    assert sum(r.stats.drafted for r in together) > 0


def test_a_narrowed_tree_drafts_fewer_rows_and_stays_lossless():
    """``Decoder.step_width`` (a batch under load): a (3, 2, 1) tree drafts at most one child per
    node while it is set, and the output still equals plain decoding; the full tree comes back
    once it is cleared."""
    build = _decoders()["tree-3-2-1"]
    cfg = GenerationConfig(max_new_tokens=24)
    want = Decoder(build().target).generate(PROMPTS[0], cfg).tokens
    narrow = build()
    narrow.step_width = 1
    got = narrow.generate(PROMPTS[0], cfg)
    assert got.tokens == want and got.stats.drafted > 0
    assert max(r for r, n in enumerate(got.stats.verify_rows) if n) <= 4  # a chain of 3 and its root
    narrow.step_width = None
    full = narrow.generate(PROMPTS[0], cfg)
    assert full.tokens == want and max(r for r, n in enumerate(full.stats.verify_rows) if n) > 4
