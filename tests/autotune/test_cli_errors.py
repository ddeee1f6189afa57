"""Bad input: one clear line on stderr, exit status 2, no traceback."""
from __future__ import annotations

import pytest

from tests.helpers import assert_one_line_error, run_cli

LONG_PROMPT = "word " * 9000  # > SmolLM2's 8192-token context


@pytest.mark.parametrize(
    "args,needles",
    [
        (["generate", "--model", "no-such-model", "--prompt", "hi"], ["unknown model 'no-such-model'", "smollm2-135m"]),
        (["generate", "--model", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["generate", "--model", "smollm2-135m", "--prompt", "hi", "--temperature", "-1"], ["temperature"]),
        (["bench", "--model", "smollm2-135m", "--task", "gsm8k", "--data", "/nonexistent/test.jsonl"], ["/nonexistent"]),
        (["bench", "--model", "smollm2-135m", "--task", "gsm9k"], ["unknown task", "gsm8k"]),
        (["bench", "--model", "smollm2-135m", "--task", "gsm8k", "--methods", "hf,warp"], ["warp", "hf-assisted"]),
        (["generate", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--draft-length", "0", "--prompt", "x"],
         ["draft_length"]),
        (["generate"], ["--model"]),
        (["generate", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--draft-precision", "int8",
          "--device", "cuda", "--prompt", "x"], ["--draft-precision int8 has no backend on 'cuda'", "bfloat16"]),
        (["generate", "--model", "smollm2-135m", "--precision", "int4", "--device", "cuda", "--prompt", "x"],
         ["--precision int4 has no backend on 'cuda'", "bfloat16"]),
        (["generate", "--model", "smollm2-135m", "--precision", "w8a8", "--compile", "--prompt", "x"],
         ["--precision w8a8 cannot be compiled", "float32"]),
        (["generate", "--model", "smollm2-135m", "--dtype", "int3", "--prompt", "x"], ["unknown precision 'int3'"]),
        (["bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--draft-precision", "int8",
          "--device", "cuda", "--task", "humaneval", "--methods", "vanilla,sd"], ["int8 has no backend on 'cuda'"]),
    ],
)
def test_fast_failures(args, needles):
    proc = run_cli(*args)
    assert_one_line_error(proc.returncode, proc.stderr, *needles, progress_bars=True)


@pytest.mark.slow
def test_draft_with_other_vocabulary():
    proc = run_cli("generate", "--model", "smollm2-135m", "--draft", "qwen2.5-coder-0.5b", "--prompt", "hi")
    assert_one_line_error(proc.returncode, proc.stderr, "different vocabulary", "same model family",
                          progress_bars=True)


@pytest.mark.slow
def test_prompt_longer_than_context():
    proc = run_cli("generate", "--model", "smollm2-135m", "--prompt", LONG_PROMPT, "--max-new-tokens", "4")
    assert_one_line_error(proc.returncode, proc.stderr, "exceeds the model context", "shorten the prompt",
                          progress_bars=True)
