"""The checks behind docs/benchmarks.md's "A lossless bug at int4, and a bf16 prefill" and "Prompt
lookup's n-grams, a faster draft head":

    python tools/quantised_checks.py identity   # plain vs the draft chain, token for token, MT-Bench 0-3
    python tools/quantised_checks.py timings    # a step, a chain verify, a tree verify, the prefill; kernels by rows
    python tools/quantised_checks.py lookup --task humaneval --limit 5 --max-new-tokens 128
                                                # prompt lookup's n-grams and lengths, replayed at timed verify costs
    python tools/quantised_checks.py heads --limit 10   # the output head at int8 / int4 vs the float head
    python tools/quantised_checks.py kernels    # a step's profile; heads by threads; int4 groups; draft fused / head
    python tools/quantised_checks.py rounds --task gsm8k --offset 2 --limit 4
                                                # a draft chain's rounds: draft forwards by rows, copy rounds
    python tools/quantised_checks.py lookup-rounds --task humaneval --offset 2 --limit 4 --length 10
                                                # prompt lookup's rounds against their prices: the
                                                # rounds the replay prices and the text's unpriced tail
    python tools/quantised_checks.py retune --storage must.db --route gsm8k --task gsm8k --offset 30 --limit 3
                                                # a forced serve --adaptive re-tune against plain decoding
    python tools/quantised_checks.py catch-up --task gsm8k --offset 20 --limit 6
                                                # a draft chain's prompt catch-up per request, against plain
    python tools/quantised_checks.py int8-kernels
                                                # w8a8's two int8 kernels by rows; the int8 head as two
                                                # int4 halves; the auto-precision probe

``identity`` decodes each prompt plainly and with the 0.5B draft chain (k=10, threshold 0.6) at the
given precision and prints where they part (none: identical), with the tokens drafted. ``timings``
prints the best-of-N time of the target's forwards after a prompt, and one MLP matrix of the 1.5B at
many rows under the int4 kernel, fp32 and bf16.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runtime.decoding import GenerationConfig  # noqa: E402
from runtime.layout import Layout  # noqa: E402
from runtime.lookup import PromptLookupDrafter  # noqa: E402
from runtime.pipeline import ModelPool, build_decoder, eos_ids  # noqa: E402
from runtime.quant import Bf16Linear, Int4WeightOnlyLinear  # noqa: E402
from runtime.tree import compile_tree, tree_tables  # noqa: E402
from search_spaces.strategy import PLAIN, Strategy  # noqa: E402
from studies import load_prompts  # noqa: E402
from studies.encode import encode_prompt  # noqa: E402


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def identity(args: argparse.Namespace) -> None:
    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    plain = build_decoder(pool, target, PLAIN)
    chain = build_decoder(pool, target, Strategy(draft_length=10, confidence_threshold=0.6), args.draft)
    for prompt in load_prompts(args.task, None, args.limit, args.offset):
        ids = encode_prompt(prompt, target.tokenizer)
        want = plain.generate(ids, cfg).tokens
        got = chain.generate(ids, cfg)
        first = next((i for i, (a, b) in enumerate(zip(want, got.tokens)) if a != b), None)
        if first is None and len(want) != len(got.tokens):
            first = min(len(want), len(got.tokens))
        where = "identical" if first is None else f"PARTS at token {first}"
        print(f"{prompt.id}: {where} ({len(want)} tokens, {got.stats.drafted} drafted)", flush=True)


def timings(args: argparse.Namespace) -> None:
    pool = ModelPool()
    lm = pool.served(pool.get(args.model, args.precision))
    prompt = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        def prefill():
            cache = lm.new_cache(args.prompt_tokens + 64)
            lm(prompt, cache, logits_for=slice(-1, None))
            return cache

        cache = prefill()
        print(f"prefill {args.prompt_tokens} tokens: {best_ms(prefill, 2):.1f} ms")
        base = cache.length
        tree = compile_tree((-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 6, 7, 9, 9, 10))  # 15 nodes + the root: 16 rows

        def rows(n: int, as_tree: bool = False) -> Callable[[], object]:
            def run():
                cache.rollback(base)
                if as_tree:
                    tables = tree_tables(tree, "cpu")
                    return lm(prompt[:n], cache, Layout.block(tables.block, tables.offsets + base))
                return lm(prompt[:n], cache)
            return run

        print(f"1-row step: {best_ms(rows(1), 5):.1f} ms")
        print(f"11-row chain verify: {best_ms(rows(11), 3):.1f} ms")
        print(f"16-row tree verify: {best_ms(rows(16, True), 3):.1f} ms")
        w = torch.randn(8960, 1536, generator=torch.Generator().manual_seed(1)) * 0.02
        int4, bf16 = Int4WeightOnlyLinear(w, None), Bf16Linear(w, None)
        for n in (16, 64, 157, 400):
            x = torch.randn(n, 1536)
            row = {name: best_ms(lambda f=f: f(x), 3) for name, f in
                   (("int4", int4), ("fp32", lambda x: torch.nn.functional.linear(x, w)), ("bf16", bf16))}
            print(f"8960x1536 at {n} rows: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row.items()))


def lookup(args: argparse.Namespace) -> None:
    """Prompt lookup's n-gram sizes and lengths, replayed as it decodes over plain greedy outputs
    (``--limit`` prompts, ``--max-new-tokens``) at the verify costs timed here by row count."""
    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    plain = build_decoder(pool, target, PLAIN)
    seqs = []
    for prompt in load_prompts(args.task, None, args.limit, args.offset):
        ids = encode_prompt(prompt, target.tokenizer)
        seqs.append((ids, plain.generate(ids, cfg).tokens))
    lm = plain.target
    ctx = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    cache = lm.new_cache(args.prompt_tokens + 32)
    lm(ctx, cache, logits_for=slice(-1, None))
    base = cache.length

    def verify(rows: int) -> Callable[[], object]:
        def run():
            cache.rollback(base)
            return lm(ctx[:rows], cache)
        return run

    cost = {r: best_ms(verify(r), 3) for r in range(1, 17)}
    print("verify ms by rows: " + ", ".join(f"{r}: {c:.0f}" for r, c in cost.items()))

    def replay(min_n: int, max_n: int, k: int) -> float:
        ms = tokens = 0.0
        for ids, out in seqs:
            drafter = PromptLookupDrafter(max_ngram=max_n, min_ngram=min_n)
            drafter.begin(ids + out[:1], 0)
            i = 1
            while i < len(out):
                proposal = drafter.propose(k, None, None).tokens.tolist()
                a = 0
                while a < len(proposal) and i + a < len(out) and proposal[a] == out[i + a]:
                    a += 1
                n = min(a + 1, len(out) - i)
                ms, tokens = ms + cost[len(proposal) + 1], tokens + n
                drafter.observe(a, out[i : i + n])
                i += n
        plain_ms = sum(len(o) - 1 for _, o in seqs) * cost[1]
        return plain_ms / ms if ms else 0.0  # decode-only speed-up over plain steps

    lengths = (3, 6, 7, 10, 11, 15)
    print("| n-grams (min, max) | " + " | ".join(f"k={k}" for k in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for min_n, max_n in ((1, 3), (1, 8), (2, 8), (3, 8)):
        print(f"| ({min_n}, {max_n}) | " + " | ".join(f"{replay(min_n, max_n, k):.2f}x" for k in lengths) + " |")


def heads(args: argparse.Namespace) -> None:
    """The output head alone at int8 and int4 against the float head (the GGUF's own weights,
    dequantised): argmax agreement and reference perplexity on the int4 model's hidden states over
    the tasks' reference answers (``--limit`` prompts each)."""
    from precision_quality import next_logits

    from runtime.quant import Int4WeightOnlyLinear

    pool = ModelPool()
    loaded = pool.get(args.model, args.precision)
    lm = pool.served(loaded)
    weight = lm.lm_head.weight.detach().float()
    variants = {"float": lambda h: h @ weight.t(), "int8": lm.head, "int4": Int4WeightOnlyLinear(weight, None)}
    served_head, lm.head = lm.head, (lambda h: h.clone())  # the forward then returns the normed hidden states
    hidden, refs = [], []
    for task in ("humaneval", "gsm8k"):
        for prompt in load_prompts(task, None, args.limit, args.offset):
            if prompt.reference:
                ref = loaded.tokenizer(prompt.reference, add_special_tokens=False)["input_ids"][:200]
                hidden.append(next_logits(lm, encode_prompt(prompt, loaded.tokenizer), ref))
                refs.append(torch.tensor(ref))
    lm.head = served_head
    h, y = torch.cat(hidden), torch.cat(refs)
    logits = {k: torch.cat([f(h[i : i + 64]).float() for i in range(0, len(h), 64)]) for k, f in variants.items()}
    top = logits["float"].argmax(-1)
    print(f"{len(h)} positions")
    for name, got in logits.items():
        ppl = torch.exp(-torch.log_softmax(got, -1).gather(1, y[:, None]).mean())
        print(f"{name} head: argmax agreement with the float head {(got.argmax(-1) == top).float().mean():.4f}, "
              f"perplexity {ppl:.4f}")


def kernels(args: argparse.Namespace) -> None:
    """Where a plain step's time goes (``torch.profiler``, 5 steps), the output head at int8 and
    int4 on one and two threads, int4 group sizes on the MLP matrices, and the draft model's step
    with and without fused projections and with its int8 / int4 head."""
    from torch.profiler import ProfilerActivity, profile

    import runtime.transformer as transformer
    from runtime.quant import Int8WeightOnlyLinear, quantise_int4

    pool = ModelPool()
    ctx = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))

    def step_of(lm) -> Callable[[], object]:
        cache = lm.new_cache(args.prompt_tokens + 8)
        lm(ctx, cache, logits_for=slice(-1, None))
        base = cache.length

        def run():
            cache.rollback(base)
            return lm(ctx[:1], cache)
        return run

    target = pool.served(pool.get(args.model, args.precision))
    step = step_of(target)
    print(f"{args.model} 1-row step: {best_ms(step, 10):.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    weight = target.lm_head.weight.detach().float()
    x = torch.randn(1, weight.shape[1])
    heads = {"int8": Int8WeightOnlyLinear(weight, None), "int4": Int4WeightOnlyLinear(weight, None)}
    threads = torch.get_num_threads()
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        print(f"head {tuple(weight.shape)} on {n} thread(s): "
              + ", ".join(f"{k} {best_ms(lambda f=f: f(x), 10):.1f} ms" for k, f in heads.items()))
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    mlp = [torch.randn(17920, 1536, generator=gen) * 0.02 for _ in range(8)]
    x = torch.randn(1, 1536)
    for group in (32, 128):
        fs = [Int4WeightOnlyLinear(w, None, quantise_int4(w, group)) for w in mlp]
        print(f"int4 group {group}, 8 fused gate/up 17920x1536 matrices: {best_ms(lambda: [f(x) for f in fs], 10):.2f} ms")
    draft = pool.get(args.draft, args.precision)
    vocab = target.dims.vocab
    for fused in (True, False):
        if not fused:
            transformer.FUSED_BACKENDS = ()
            pool = ModelPool()  # fresh wrappers, built unfused
            draft = pool.get(args.draft, args.precision)
        for name, lm in (("as a target (int8 head)", pool.served(draft)),
                         ("as a draft", pool.draft_wrapper(draft, target.backend, None, vocab))):
            print(f"{args.draft} step {'fused' if fused else 'one call per projection'}, {name}, "
                  f"head {lm.head.kind}: {best_ms(step_of(lm), 15):.1f} ms")


def rounds(args: argparse.Namespace) -> None:
    """A draft chain's rounds as they decode (``--length``, lookup first as GSM8K's study stored
    it): the draft model's forwards by rows, rounds with and without a checked lookup copy, and the
    catch-ups over the prompt (before the first round since ``Decoder.draft_prefill``)."""
    import statistics

    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    strategy = Strategy(drafter="draft-model", draft_length=args.length, confidence_threshold=0.0, lookup_first=True)
    dec = build_decoder(pool, target, strategy, args.draft)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    drafter = dec.drafter_of("draft-model")
    model, calls = drafter.model, []
    run_model = type(model).__call__

    class Timed(type(model)):  # the draft model, timing each forward by its rows
        def __call__(self, ids, *a, **kw):
            start = time.perf_counter()
            out = run_model(self, ids, *a, **kw)
            calls.append((int(ids.shape[0]), time.perf_counter() - start))
            return out

    model.__class__ = Timed
    per_round, prompt_catch_ups = [], []
    for j, prompt in enumerate(load_prompts(args.task, None, args.limit, args.offset)):
        calls.clear()
        state: dict[str, int] = {}

        def hook(d, tokens, cache, stats, j=j, state=state):
            if state:
                per_round.append((j, d.drafter.lookup_rounds - state["lookups"], list(calls)))
            else:  # before the first round: the prompt's catch-up, if it ran there
                prompt_catch_ups.extend((j, r, round(s, 3)) for r, s in calls)
            calls.clear()
            state["lookups"] = d.drafter.lookup_rounds

        got = dec.generate(encode_prompt(prompt, target.tokenizer), cfg, before_round=hook)
        print(f"{prompt.id}: decode {got.stats.decode_tokens_per_s:.2f} tok/s, {got.stats.target_forwards - 1} rounds, "
              f"draft {1e3 * got.stats.draft_s / max(got.stats.target_forwards - 1, 1):.1f} ms/round, "
              f"prefill {got.stats.prefill_s:.2f} s", flush=True)
    by_rows: dict[int, list[float]] = {}
    for j, _, forwards in per_round:
        if j:  # the first prompt pays the process's first-call costs
            for r, s in forwards:
                by_rows.setdefault(r, []).append(s)
    print("draft forwards in rounds, ms by rows (count, median):",
          {r: (len(v), round(1e3 * statistics.median(v), 1)) for r, v in sorted(by_rows.items())})
    for copied in (0, 1):
        xs = [(len(f), sum(s for _, s in f)) for j, c, f in per_round if j and c == copied]
        if xs:
            print(f"rounds {'with' if copied else 'without'} a lookup copy: {len(xs)}, forwards per round "
                  f"{statistics.mean(x[0] for x in xs):.2f}, draft {1e3 * statistics.mean(x[1] for x in xs):.1f} ms")
    print("the prompt's catch-up before the first round (prompt, rows, s):", prompt_catch_ups)


def lookup_rounds(args: argparse.Namespace) -> None:
    """Prompt lookup (``--length``) as it decodes, against what the study prices on the same text
    (``candidates.price_text``: one window over the tokens decoded, the study's cost model timed here
    at the prompts' mean context; before the tuner's correction). The window replay starts
    rounds only where a full draft still fits (``objective._starts``), so the text's last
    ``--length`` tokens are not priced (the study's horizon is its space's longest draft, so its
    tail is at least as long); the decode's rounds are split the same way (those starting before
    that tail, and the tail's). Also each round's verify time against the timed forward of its
    row count."""
    import statistics

    from autotune.tuning.cost_model import MeasuredCostModel
    from autotune.tuning.matchness import lookup_match
    from autotune.tuning.objective import _starts
    from autotune.tuning.scoring import Window

    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    strategy = Strategy(drafter="prompt-lookup", draft_length=args.length)
    dec = build_decoder(pool, target, strategy)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    prompts = [encode_prompt(p, target.tokenizer) for p in load_prompts(args.task, None, args.limit, args.offset)]
    mean_len = sum(len(p) for p in prompts) // max(len(prompts), 1)
    cost = MeasuredCostModel(draft=dec.target, target=dec.target, verify_width=dec.verify_width,
                             context=mean_len + args.max_new_tokens // 2, repeats=3, padded=dec.pads)
    with torch.inference_mode():
        cost.prepare()
        dec.generate(prompts[0], GenerationConfig(max_new_tokens=16, eos_token_ids=eos_ids(target)))  # first calls
    by_rows: dict[int, list[float]] = {}
    sums = {"pred_s": 0.0, "priced": [0, 0.0], "tail": [0, 0.0]}  # [tokens, seconds] of decoded rounds
    proposals: list[tuple[int, int, int]] = []  # (position, length asked, tokens proposed) per decoded round
    propose = dec.drafter.propose

    def logged(k, *a, **kw):
        draft = propose(k, *a, **kw)
        proposals.append((len(dec.drafter.history), k, int(draft.tokens.numel())))
        return draft

    dec.drafter.propose = logged
    differ = checked = 0
    for ids in prompts:
        proposals.clear()
        rounds: list[tuple[int, int, float]] = []  # (start position, tokens, seconds) per decoded round
        marks: dict[str, float] = {}

        def hook(d, tokens, cache, stats, marks=marks, rounds=rounds):
            spent = stats.draft_s + stats.verify_s
            if marks:
                by_rows.setdefault(d.last_rows, []).append(stats.verify_s - marks["v"])
                rounds.append((int(marks["at"]), len(tokens) - int(marks["at"]), spent - marks["s"]))
            marks.update(v=stats.verify_s, s=spent, at=len(tokens))

        got = dec.generate(ids, cfg, before_round=hook)
        st = got.stats
        if marks:  # the last round
            total = len(ids) + len(got.tokens)
            rounds.append((int(marks["at"]), total - int(marks["at"]), st.draft_s + st.verify_s - marks["s"]))
        new = len(got.tokens) - 1  # the prefill's token is not a round's
        # the replay's proposal at each position a round started, cut to the length the decoder asked
        match = lookup_match(ids + got.tokens, new, args.length)
        base = len(ids) + 1
        for at, k, n in proposals:
            if 0 <= at - base < len(match.proposed):
                checked += 1
                differ += min(match.proposed[at - base], k) != n
        pred = Window(new, args.length, cost).predict(dec, strategy, ids + got.tokens)
        if pred is None or not rounds:
            continue
        tail_from = base + len(_starts(new, args.length, None))  # rounds starting here are in the unpriced tail
        priced = [(n, sec) for at, n, sec in rounds if at < tail_from]
        tail = [(n, sec) for at, n, sec in rounds if at >= tail_from]
        for name, part in (("priced", priced), ("tail", tail)):
            sums[name][0] += sum(n for n, _ in part)
            sums[name][1] += sum(sec for _, sec in part)
        sums["pred_s"] += sum(n for n, _ in priced) / pred[0].tokens_per_s
        tps = new / (st.draft_s + st.verify_s)
        ptps = sum(n for n, _ in priced) / max(sum(sec for _, sec in priced), 1e-9)
        print(f"{len(ids)} prompt tokens, {new} decoded in {len(rounds)} rounds: {tps:.2f} tok/s; rounds before the "
              f"tail {ptps:.2f} tok/s; the tail's {len(tail)} rounds {sum(n for n, _ in tail)} tokens; predicted "
              f"{pred[0].tokens_per_s:.2f}", flush=True)
    (pn, ps), (tn, ts) = sums["priced"], sums["tail"]
    if not pn:
        print("no rounds decoded")
        return
    pred_tps = pn / sums["pred_s"]
    print(f"predicted / measured: {pred_tps / ((pn + tn) / (ps + ts)):.3f} over every round, {pred_tps / (pn / ps):.3f} "
          f"over the rounds the replay prices (the tail: {tn} tokens at {tn / ts if ts else 0.0:.2f} tok/s)")
    print(f"proposals: the decode's and the replay's differ at {differ} of the {checked} rounds' positions")
    print("verify by rows: rounds, measured median ms, priced ms:",
          {r: (len(v), round(1e3 * statistics.median(v), 1), round(1e3 * cost.verify_s(float(r)), 1))
           for r, v in sorted(by_rows.items())})


def retune(args: argparse.Namespace) -> None:
    """A forced re-tune of ``serve --adaptive`` (``--route``: a stored task, or ``unknown``) on the
    task's prompts, against plain decoding: the server built as ``serve`` builds it on a copy of
    ``--storage`` (a SQLite file), then per prompt the worker's plain decoder, the re-tune's own
    decoder decoding plainly (no tuner), and the re-tune's request (its tuner between rounds),
    with the tuning time and trials each request carried."""
    import shutil
    import tempfile

    from autotune.serving.adaptive.health import RouteHealth
    from autotune.serving.adaptive.settings import AdaptSettings
    from autotune.serving.server import ServeConfig, build_server
    from autotune.store.storage import open_storage
    from studies import Prompt, routing_text

    if not args.storage or not Path(args.storage).is_file():
        raise SystemExit(f"retune needs --storage FILE, a SQLite store of studies (got {args.storage!r})")
    copy = Path(tempfile.mkdtemp()) / "store.db"
    shutil.copy(args.storage, copy)
    url = f"sqlite:///{copy}"
    with open_storage(url) as storage:
        server = build_server(ServeConfig(model=args.model, draft=args.draft, dtype=args.precision, storage=url,
                                          adaptive=AdaptSettings(), max_batch=1), storage)
        worker, adapter = server.worker, server.worker.adapter
        entry = next((e for e in server.book.entries if e.task == args.route), None)
        strategy = entry.strategy if entry is not None else PLAIN
        health = adapter.health[args.route] = RouteHealth(args.route, strategy, "forced", stored_acceptance=None)
        adapter._start(health, "forced by tools/quantised_checks.py retune")
        job = adapter.retunes[args.route]
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(worker.target))
        plain, own = worker.decoders.decoder(PLAIN), adapter._decoder()
        print(f"re-tune of {args.route} (stored: {strategy.to_json()})")
        for p in load_prompts(args.task, None, args.limit, args.offset):
            ids = encode_prompt(Prompt(id=p.id, messages=(("user", routing_text(p)),)), worker.target.tokenizer)
            times = {}
            for name, run in (("plain", lambda: plain.generate(ids, cfg)), ("own decoder", lambda: own.generate(ids, cfg))):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    run()
                times[name] = time.perf_counter() - t0
            state = job.tuner.state
            before = (state.tuning_s, state.trials)
            t0 = time.perf_counter()
            got = job.generate(ids, cfg, "", None)
            times["re-tune"] = time.perf_counter() - t0
            print(f"{p.id}: {len(ids)} prompt tokens; s: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
                  + f"; re-tune / plain {times['plain'] / times['re-tune']:.2f}x, tuning {state.tuning_s - before[0]:.2f} s, "
                  f"trials {state.trials - before[1]}, drafted {got.stats.drafted}", flush=True)


def catch_up(args: argparse.Namespace) -> None:
    """A draft chain's prompt catch-up request by request, as a route's decoder meets them: the
    server's decoder of GSM8K's stored strategy (the chain k=``--length`` checking a lookup copy
    first, prompt lookup on standby), warmed on a dummy prompt as ``serve`` warms it, decodes the
    task's prompts one after another beside plain decoding. Per prompt: the prefix its draft cache
    already held, the catch-up (its prefill less plain decoding's) and both decodes."""
    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    chain = Strategy(draft_length=args.length, confidence_threshold=0.0, lookup_first=True)
    spec = build_decoder(pool, target, chain, args.draft, verify_width=max(args.length, 8) + 1,
                         standby=[Strategy(drafter="prompt-lookup", draft_length=8)])
    plain = build_decoder(pool, target, PLAIN)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    for dec in (spec, plain):  # what DecodeWorker.warm_up decodes at start-up
        dec.generate(list(range(1, 9)), GenerationConfig(max_new_tokens=24))
    for p in load_prompts(args.task, None, args.limit, args.offset):
        ids = encode_prompt(p, target.tokenizer)
        rows = spec.drafter.exact_rows
        held = next((i for i, (a, b) in enumerate(zip(rows, ids)) if a != b), min(len(rows), len(ids)))
        got, want = spec.generate(ids, cfg), plain.generate(ids, cfg)
        s, q = got.stats, want.stats
        print(f"{p.id}: {len(ids)} prompt tokens, draft cache held {held}; catch-up {s.prefill_s - q.prefill_s:.2f} s; "
              f"chain: prefill {s.prefill_s:.2f} s, rounds {s.wall_s - s.prefill_s:.2f} s; plain: prefill "
              f"{q.prefill_s:.2f} s, rounds {q.wall_s - q.prefill_s:.2f} s; whole request {q.wall_s / s.wall_s:.2f}x plain; "
              f"identical {got.tokens == want.tokens}", flush=True)


def int8_kernels(args: argparse.Namespace) -> None:
    """The int8 kernels by rows (docs: the issue 26 re-run on an AMD EPYC): ``torch._int_mm``
    against oneDNN's packed int8 linear over 24 distinct 8960x1536 matrices; the int8 output head
    (151936x1536, weight-only kernel) against the same int8 weights run as two int4 nibble halves
    through the int4 kernel (``q8 = 16 hi + lo``), at 1 and 11 rows; and ``--precision auto``'s probe."""
    from runtime import auto_precision
    from runtime.quant import Int8WeightOnlyLinear, quantise_int8

    gen = torch.Generator().manual_seed(0)
    qs = [torch.randint(-127, 128, (8960, 1536), dtype=torch.int8, generator=gen) for _ in range(24)]
    w_scale = torch.rand(8960, generator=gen) * 0.01
    packed = [torch.ops.onednn.qlinear_prepack(q, None) for q in qs]
    zero = torch.zeros(8960, dtype=torch.int64)
    for rows in (1, 2, 4, 8, 16):
        x = torch.randint(-127, 128, (rows, 1536), dtype=torch.int8, generator=gen)
        xu = (x.to(torch.int16) + 128).to(torch.uint8)
        int_mm = best_ms(lambda: [torch._int_mm(x, q.t()) for q in qs], 5)
        onednn = best_ms(lambda: [torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, p, w_scale, zero, None, 1.0, 0,
                                                                    torch.float32, "none", [], "") for p in packed], 5)
        print(f"24 x 8960x1536 int8 at {rows} rows: _int_mm {int_mm:.1f} ms, oneDNN packed {onednn:.1f} ms", flush=True)
    del qs, packed
    vocab, hidden = 151936, 1536
    w = torch.randn(vocab, hidden, generator=gen) * 0.02
    int8 = Int8WeightOnlyLinear(w, None)
    q8, scale = quantise_int8(w)
    hi = torch.div(q8.int(), 16, rounding_mode="floor")  # -8..7
    lo = q8.int() - 16 * hi  # 0..15
    halves = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat([hi + 8, lo]).to(torch.int32), 1)
    group, sb = 256, scale.to(torch.bfloat16)
    scale_zero = torch.stack([torch.cat([sb * 16, sb])[None].expand(hidden // group, -1),
                              torch.cat([torch.zeros_like(sb), sb * 8])[None].expand(hidden // group, -1)], -1).contiguous()

    def split(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), halves, group, scale_zero)
        return y[:, :vocab].float() + y[:, vocab:].float()

    for rows in (1, 11):
        x = torch.randn(rows, hidden, generator=gen)
        print(f"head {vocab}x{hidden} at {rows} rows: int8 kernel {best_ms(lambda: int8(x), 10):.1f} ms, "
              f"two int4 halves {best_ms(lambda: split(x), 10):.1f} ms", flush=True)
    seconds = auto_precision.probe()
    print("auto-precision probe (1 + 8 rows, 8 x 8960x1536): "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items())
          + f" -> {min(seconds, key=seconds.get)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=("identity", "timings", "lookup", "heads", "kernels", "rounds", "lookup-rounds",
                                      "retune", "catch-up", "int8-kernels"))
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--task", default="mt-bench")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--length", type=int, default=2, help="rounds, lookup-rounds: the draft length")
    ap.add_argument("--storage", help="retune: a SQLite store file of studies (copied, never written)")
    ap.add_argument("--route", default="unknown", help="retune: the route re-tuned (a stored task, or unknown)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    {"identity": identity, "timings": timings, "lookup": lookup, "heads": heads, "kernels": kernels,
     "rounds": rounds, "lookup-rounds": lookup_rounds, "retune": retune, "catch-up": catch_up,
     "int8-kernels": int8_kernels}[args.check](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
