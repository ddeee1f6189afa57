"""Bad input: one clear line on stderr, exit status 2, no traceback."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

LONG_PROMPT = "word " * 9000  # > SmolLM2's 8192-token context


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=600
    )


PROGRESS = re.compile(r"\d+%\|.*\|")  # tqdm bars, e.g. a model's first dequantisation into the cache


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """One line of error on stderr (progress bars of a first model load aside), exit 2."""
    lines = [line for line in re.split(r"[\r\n]", proc.stderr) if line.strip() and not PROGRESS.search(line)]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


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
          "--device", "cuda", "--prompt", "x"], ["--draft-precision int8 runs only on cpu", "bfloat16"]),
        (["bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--draft-precision", "int8",
          "--device", "cuda", "--task", "humaneval", "--methods", "vanilla,sd"], ["int8 runs only on cpu"]),
    ],
)
def test_fast_failures(args, needles):
    assert_one_line_error(run_cli(*args), *needles)


@pytest.mark.slow
def test_draft_with_other_vocabulary():
    proc = run_cli("generate", "--model", "smollm2-135m", "--draft", "qwen2.5-coder-0.5b", "--prompt", "hi")
    assert_one_line_error(proc, "different vocabulary", "same model family")


@pytest.mark.slow
def test_prompt_longer_than_context():
    proc = run_cli("generate", "--model", "smollm2-135m", "--prompt", LONG_PROMPT, "--max-new-tokens", "4")
    assert_one_line_error(proc, "exceeds the model context", "shorten the prompt")
