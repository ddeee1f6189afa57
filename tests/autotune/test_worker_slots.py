"""``serve --compile`` with batching: the decode worker keeps each running sequence's K/V in a slot
of one cache and compiles a batched step per row bucket before serving (tiny random model); the
worker's own measured choices (SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from autotune.serving.startup import compile_buckets, profile_steps, use_slots
from autotune.serving.worker import DecodeWorker
from autotune.serving.worker_config import WorkerConfig
from runtime.compiled import NEW_STEPS
from runtime.decoding import GenerationConfig
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool
from runtime.slots import SlotView
from runtime.testing import tiny_model
from search_spaces.strategy import PLAIN, Strategy


def _worker(compile: bool, max_batch: int = 4) -> DecodeWorker:
    target = LoadedModel("tiny", "tiny", "0", tiny_model("llama", 3, layers=2), None)
    return DecodeWorker(ModelPool(compile=compile), target, None,
                        WorkerConfig(max_queue=4, max_batch=max_batch, max_batch_rows=16))


@pytest.mark.heavy  # compiles five graphs (about 50 s); compiled slot steps' identity stays in tests/runtime/test_batching.py
def test_a_compiled_worker_keeps_sequences_in_slots_and_compiles_each_row_bucket():
    worker = _worker(compile=True)
    decoders, step_cost = worker.decoders, lambda: worker.figures.step_cost
    per_slot = use_slots(worker, 64)
    assert per_slot > 0 and decoders.slots.n_slots == 5  # a slot per running request, one for a re-tune
    before = NEW_STEPS[0]
    assert compile_buckets(worker) > 0
    assert NEW_STEPS[0] - before == 5  # row buckets 1, 2, 4, 8, 16: one graph each
    assert decoders.slots.free == decoders.slots.n_slots  # the warm-up's slot was given back
    lm, padded = decoders.batch_target(), []
    forward_rows = lm.forward_rows
    lm.forward_rows = lambda tokens, *rest: (padded.append(tokens.shape[0]), forward_rows(tokens, *rest))[1]
    profile_steps(worker)  # the step-cost profile times the compiled slot steps requests will run
    del lm.forward_rows
    assert NEW_STEPS[0] - before == 5  # ... with no graph of its own
    assert sorted(set(padded)) == [1, 2, 4, 8, 16] and len(padded) == 2 * len(step_cost().profile)
    assert max(r for r, _, _ in step_cost().profile) <= 16 and decoders.slots.free == decoders.slots.n_slots
    dec = decoders.acquire(PLAIN)
    assert dec.target.slots is decoders.slots
    with torch.inference_mode():
        seq = dec.start([5, 6, 7], GenerationConfig(max_new_tokens=8))
    assert isinstance(seq.cache, SlotView) and decoders.slots.free == decoders.slots.n_slots - 1
    decoders.release(PLAIN, dec)
    assert decoders.slots.free == decoders.slots.n_slots


def test_an_eager_or_unbatched_worker_keeps_its_own_caches():
    assert use_slots(_worker(compile=False), 64) == 0
    assert use_slots(_worker(compile=True, max_batch=1), 64) == 0


def test_a_reset_empties_the_prefix_cache_and_each_decoder_forgets_its_rows_once_before_its_next_request():
    target = LoadedModel("tiny", "tiny", "0", tiny_model("llama", 3, layers=2), None)
    worker = DecodeWorker(ModelPool(), target, None,
                          WorkerConfig(max_queue=4, max_batch=2, max_batch_rows=16, prefix_cache_bytes=2**24))
    decoders = worker.decoders
    dec = decoders.acquire(PLAIN)
    forgot: list[int] = []
    dec.forget_rows = lambda: forgot.append(1)
    dec.generate(list(range(1, 40)), GenerationConfig(max_new_tokens=4))  # its rows go to the prefix cache
    decoders.release(PLAIN, dec)
    assert decoders.prefix.stats.used_bytes > 0 and not forgot
    assert decoders.reset_rows() > 0 and decoders.prefix.stats.used_bytes == 0 == decoders.prefix.stats.blocks
    for _ in range(2):  # once per reset, as it is next acquired
        assert decoders.acquire(PLAIN) is dec and forgot == [1]
        decoders.release(PLAIN, dec)
    assert decoders.reset_rows() == 0
    decoders.acquire(PLAIN)
    assert forgot == [1, 1]


def test_a_request_runs_its_drafting_model_over_the_prompt_only_before_it_drafts():
    """The draft model's prompt catch-up waits for the first step the load-aware choice lets the
    request draft in (a loaded batch that never does never pays for it), and runs once; its price
    per token is kept for the next request's choice."""
    from types import SimpleNamespace

    from autotune.serving.jobs import Running
    from runtime.batching import Member

    calls = []
    seq = SimpleNamespace(prompt=[1] * 30, out=[2] * 10, stats=SimpleNamespace(prefill_s=0.0))
    chain = Strategy(draft_length=4)

    class Recording:  # the decoder's side the worker drives here: its step cap and its draft prefill
        step_cap = 0

        def draft_prefill(self, seq):
            calls.append(seq)
            seq.stats.prefill_s += 0.04
            return 39  # the prompt and the first tokens, all but the last

    worker = _worker(compile=False)
    r = Running(job=None, member=Member(Recording(), seq), strategy=chain)
    worker.loop.sync_drafters([r])
    assert calls == [] and not r.drafter_synced and worker.figures.catch_ups == {}
    r.member.decoder.step_cap = 3
    worker.loop.sync_drafters([r])
    worker.loop.sync_drafters([r])
    assert calls == [seq] and r.drafter_synced
    assert set(worker.figures.catch_ups) == {chain.drafter}
    assert worker.figures.catch_ups[chain.drafter].predict(39) == pytest.approx(0.04)  # its one catch-up: 39 tokens, 0.04 s


@pytest.mark.slow
def test_unknown_requests_start_on_a_draft_only_where_this_server_measured_it_paying(pool, smollm):
    """``Control.unknown_start`` (SmolLM2, float32, real timings): a chain of 10 that always
    drafts its cap, drafted by SmolLM2 itself (about half a target step a token at int4), costs some
    six plain steps a round for the 2.49 tokens acceptance 0.6 expects, so unknown requests start
    plain; prompt lookup (no draft forward, a 5-row verify) pays, so it is kept."""
    control = DecodeWorker(pool, smollm, "smollm2-135m", WorkerConfig(max_queue=4, max_batch=2)).control
    assert control.unknown_start(Strategy(confidence_threshold=0.0)) == PLAIN
    lookup = Strategy(drafter="prompt-lookup", draft_length=4)
    assert control.unknown_start(lookup) == lookup
    assert control.unknown_start(PLAIN) == PLAIN


def test_a_start_drafts_only_where_priced_the_switch_margin_above_plain():
    """The start-up and live judgements of ``unknown`` traffic start a draft only where it is
    priced ``ControlSettings.margin`` above plain decoding, as a controller needs to leave plain:
    the default chain (k=10, threshold 0.6) at acceptance 0.6, a draft token 0.45 plain steps and
    a 2-row verify 1.1, is priced 1.032x plain at its best length (one draft) - within two timings'
    spread of one verify (1.11x and 1.28x plain on the Qwen pair at gguf) - and starts plainly.
    Power check: with no margin the same prices start it drafting."""
    from autotune.serving.control import Control
    from autotune.tuning.controller import ControlSettings
    from autotune.tuning.cost_model import FixedCostModel
    from autotune.tuning.load import RouteAcceptance

    cost = FixedCostModel(draft_full_s=0.45, verify_const_s=1.0, verify_row_s=0.1)
    for settings, pays in ((ControlSettings(), False), (None, False), (ControlSettings(margin=0.0), True),
                           (ControlSettings(margin=0.03), True)):
        assert Control(settings, None, RouteAcceptance())._pays(cost, Strategy(), 0.6) is pays, settings


def test_a_lone_request_on_its_slot_runs_the_row_buckets_graph_where_cuda_graphs_replay(monkeypatch):
    """On CUDA a lone request's compiled step on its slot runs as a batched step (the row bucket's
    graph over the whole slot cache, the tensor CUDA graphs hold by address): a graph of the
    slot's own view was skipped by inductor on an H200 ("mutated inputs"). Forced here on the
    CPU: the lone decode (plain, then prompt lookup's verifies) goes through the bucket graphs and
    returns what the eager decode returns."""
    import runtime.step_runner
    import runtime.transformer

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    cfg = GenerationConfig(max_new_tokens=12)
    lookup = Strategy(drafter="prompt-lookup", draft_length=3)
    eager = _worker(compile=False)
    want = [eager.decoders.decoder(s).generate(prompt, cfg).tokens for s in (PLAIN, lookup)]
    monkeypatch.setattr(runtime.transformer, "cuda_graphs", lambda device: True)
    monkeypatch.setattr(runtime.step_runner, "cuda_graphs", lambda device: True)
    worker = _worker(compile=True)
    use_slots(worker, 64)
    padded: list[int] = []
    for strategy, tokens in zip((PLAIN, lookup), want):
        dec = worker.decoders.acquire(strategy)
        forward_rows = dec.target.forward_rows
        dec.target.forward_rows = lambda t, *rest, f=forward_rows: (padded.append(t.shape[0]), f(t, *rest))[1]
        with torch.inference_mode():
            got = dec.generate(prompt, cfg)
        worker.decoders.release(strategy, dec)
        assert got.tokens == tokens
    assert got.stats.drafted > 0
    assert padded and set(padded) <= {1, 2, 4, 8} and max(padded) >= 4  # lookup's verifies: 4 rows
