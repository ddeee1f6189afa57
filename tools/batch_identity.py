"""How often fp32 continuous batching changes a greedy decode (docs/benchmarks.md, issue 28).

SmolLM2 in fp32, 24 prompts (GSM8K, HumanEval, MT-Bench 30-37), 64 tokens: each prompt decoded
alone, then in batches of 4 and 8 (``runtime.batching.generate_batch``) with plain decoding and an
int8-draft chain, the batch target dense or packed for 11 rows. Prints how many sequences differ.

    AUTOTUNE_DATA_DIR=../shared/data python tools/batch_identity.py
"""
from __future__ import annotations

from runtime.batching import BatchRequest, generate_batch
from runtime.decoding import GenerationConfig
from runtime.pipeline import ModelPool, build_decoder, eos_ids
from search_spaces.strategy import PLAIN, Strategy
from studies import encode_prompt, load_prompts


def main() -> None:
    pool = ModelPool()
    model = pool.get("smollm2-135m", "float32")
    prompts = [encode_prompt(p, model.tokenizer) for task in ("gsm8k", "humaneval", "mt-bench")
               for p in load_prompts(task, None, 8, 30)]
    cfg = GenerationConfig(max_new_tokens=64, eos_token_ids=eos_ids(model))
    for label, strategy in (("plain", PLAIN), ("chain", Strategy(draft_length=4, draft_precision="int8"))):
        draft = "smollm2-135m" if strategy.speculates else None
        width = 11 if strategy.speculates else None

        def decoder():
            return build_decoder(pool, model, strategy, draft, verify_width=width)

        alone = [decoder().generate(p, cfg).tokens for p in prompts]
        targets = (("dense", pool.served(model)), ("packed-11", pool.target_for_width(model, "mkl-packed", 11)))
        for target_label, target in targets:
            for size in (4, 8):
                differ = tokens = 0
                for i in range(0, len(prompts), size):
                    got = generate_batch(target, [BatchRequest(decoder(), p, cfg) for p in prompts[i : i + size]])
                    for j, result in enumerate(got):
                        tokens += len(result.tokens)
                        differ += result.tokens != alone[i + j]
                print(f"{label}, batch target {target_label}, batches of {size}: {differ} of {len(prompts)} "
                      f"sequences differ ({tokens} tokens)", flush=True)


if __name__ == "__main__":
    main()
