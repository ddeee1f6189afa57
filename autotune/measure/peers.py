"""llama.cpp as a ``bench`` peer: ``llamacpp``, ``llamacpp-draft`` and ``llamacpp-lookup``.

All three run one llama.cpp tool, ``llama-speculative-simple``, on the very GGUF files our model
aliases are built from (``runtime.models``), with our rendered prompt text, greedy (``--temp 0``),
our thread count and our token budget, so the three rows share one decode loop and one set of
timers and differ only in the drafter:

- ``llamacpp``: an n-gram drafter that cannot match (n = m = 1024 needs a history over 2049
  tokens, checked: a row that drafted is refused), i.e. one target forward per token: plain decoding.
- ``llamacpp-draft``: ``--spec-type draft-simple`` with the bench's ``--draft`` GGUF, n-max 16
  (option ``kN``), p-min 0.75.
- ``llamacpp-lookup``: ``--spec-type ngram-simple``, prompt lookup over the history: the last 3
  tokens matched, up to 16 (``kN``) tokens proposed.

tok/s is llama.cpp's own timers (prompt + decode, the lines ``encoded ... in S seconds`` and
``decoded N tokens in S seconds``), model load left out, over the N tokens it decoded: the way our
rows count (``new_tokens / wall_s``, prefill included). Its last round can run past the budget (a
draft is not capped when one token is left), so N may exceed ``--max-new-tokens``: those tokens and
their time both count; the agreement reads the first ``--max-new-tokens``. Acceptance is its
``n_accept / n_drafted``.
The tool prints text, not ids: the text after the echoed prompt is re-tokenised with our tokenizer,
and rows are compared by agreement (``agreement``), not identity. ``llama-tokenize`` checks once per
prompt that llama.cpp reads the prompt text as our token ids.

Built by ``make peers`` into ``$AUTOTUNE_LLAMACPP_DIR`` (default ``~/.cache/autotune/peers/llama.cpp``).
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.decoding import GenerationConfig
from runtime.loading import _join_and_verify, _package_dir, cache_root
from runtime.models import MODEL_ALIASES, PackagedGGUF, resolve_model
from runtime.stats import DecodeStats

from autotune.errors import MethodError

ENV_DIR = "AUTOTUNE_LLAMACPP_DIR"
TOOL = "llama-speculative-simple"
TOKENIZE_TOOL = "llama-tokenize"
TIMEOUT_S = 1800
TIMING_NOTE = "llama.cpp's own timers, prompt + decode (model load excluded), over every token it decoded"
DRAFT_N_MAX = 16  # llamacpp-draft: --spec-draft-n-max (llama-speculative-simple's settings)
DRAFT_P_MIN = 0.75
LOOKUP_N = 3  # llamacpp-lookup: n-gram matched (our `lookup` tries 3, 2, 1)
LOOKUP_M = 16  # llamacpp-lookup: tokens proposed after a match
NEVER = 1024  # llamacpp: an n-gram size no prompt of ours reaches (needs a history over 2 * NEVER + 1)


@dataclass
class PeerRun:
    tokens: list[int]  # the tool's text re-tokenised with our tokenizer
    stats: DecodeStats
    info: dict[str, Any] = field(default_factory=dict)


PeerMethod = Callable[[list[int], GenerationConfig], PeerRun]


# ---------------------------------------------------------------------- where things are
def llamacpp_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or cache_root() / "peers" / "llama.cpp").expanduser()


def find_tool(name: str = TOOL) -> Path:
    """The built tool (``DIR/bin/NAME``, or a llama.cpp build tree's ``DIR/build/bin/NAME``)."""
    root = llamacpp_dir()
    for path in (root / "bin" / name, root / "build" / "bin" / name, root / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise MethodError(
        f"llama.cpp is not built: no {name} under {root}; run `make peers` (10-25 minutes), "
        f"or set ${ENV_DIR} to a directory holding bin/{name}"
    )


def llamacpp_version() -> str:
    stamp = llamacpp_dir() / "VERSION"
    return stamp.read_text().strip() if stamp.is_file() else "unknown"


def gguf_file(alias: str) -> Path:
    """The GGUF file behind a model alias: in its package, or its chunks joined once into the cache."""
    source = MODEL_ALIASES.get(alias) or resolve_model(alias)
    if not isinstance(source, PackagedGGUF):
        packaged = ", ".join(a for a, s in MODEL_ALIASES.items() if isinstance(s, PackagedGGUF))
        raise MethodError(f"llama.cpp methods run the GGUF file of a packaged model alias ({packaged}); got {alias!r}")
    if len(source.chunks) == 1:
        pkg, rel = source.chunks[0]
        return _package_dir(pkg, source.pip_specs) / rel
    dest = cache_root() / "gguf" / f"{source.sha256[:12]}-{source.filename}"
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        _join_and_verify(source, dest)
    return dest


# ---------------------------------------------------------------------- the three variants
@dataclass(frozen=True)
class Variant:
    name: str
    needs_draft: bool
    args: Callable[[dict[str, str], str | None, int], list[str]]  # (options, draft GGUF, threads) -> flags
    describe: str


def _plain_args(options: dict[str, str], draft: str | None, threads: int) -> list[str]:
    n = str(NEVER)
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", n, "--spec-ngram-simple-size-m", n]


def _draft_args(options: dict[str, str], draft: str | None, threads: int) -> list[str]:
    assert draft is not None
    return [
        "--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", options.get("k", str(DRAFT_N_MAX)),
        "--spec-draft-p-min", str(DRAFT_P_MIN), "-td", str(threads), "-tbd", str(threads),
    ]


def _lookup_args(options: dict[str, str], draft: str | None, threads: int) -> list[str]:
    return [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LOOKUP_N),
        "--spec-ngram-simple-size-m", options.get("k", str(LOOKUP_M)),
    ]


VARIANTS: dict[str, Variant] = {
    "llamacpp": Variant("llamacpp", False, _plain_args, "plain greedy decoding (no draft ever proposed)"),
    "llamacpp-draft": Variant(
        "llamacpp-draft", True, _draft_args, f"draft-simple, --draft GGUF, n-max {DRAFT_N_MAX} (kN), p-min {DRAFT_P_MIN}"
    ),
    "llamacpp-lookup": Variant(
        "llamacpp-lookup", False, _lookup_args, f"ngram-simple prompt lookup, n {LOOKUP_N}, m {LOOKUP_M} (kN)"
    ),
}


def check_ready(name: str, model: str, draft: str | None, random_weights: bool = False) -> None:
    """Fail before any model loads: tool built, real GGUF weights, a draft where one is needed."""
    variant = VARIANTS[name]
    find_tool()
    find_tool(TOKENIZE_TOOL)
    if random_weights:
        raise MethodError(f"method {name!r} runs the real GGUF weights; drop --random-weights")
    if variant.needs_draft and draft is None:
        raise MethodError(f"method {name!r} needs a draft model; pass --draft MODEL")
    for alias in (model, draft if variant.needs_draft else None):
        if alias is not None and not isinstance(MODEL_ALIASES.get(alias), PackagedGGUF):
            gguf_file(alias)  # raises the one-line error naming the packaged aliases


def check_methods_ready(names: Sequence[str], model: str, draft: str | None, random_weights: bool) -> None:
    """``check_ready`` for every peer among the bench's method names (others need nothing from here)."""
    for name in names:
        if name in VARIANTS:
            check_ready(name, model, draft, random_weights)


# ---------------------------------------------------------------------- parsing the tool's output
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTER = re.compile(r"^.*\b(n_drafted|n_accept|n_predict)\s*=\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ToolReport:
    prompt_tokens: int
    prefill_s: float
    new_tokens: int
    decode_s: float
    drafted: int
    accepted: int


def parse_report(stderr: str) -> ToolReport:
    """llama-speculative-simple's timing and acceptance lines (its log on stderr)."""
    enc, dec = _ENCODED.search(stderr), _DECODED.search(stderr)
    counters = dict((k, int(v)) for k, v in _COUNTER.findall(stderr))
    if enc is None or dec is None or "n_drafted" not in counters or "n_accept" not in counters:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{TOOL}: no timing/acceptance lines in its output: {tail}")
    return ToolReport(
        prompt_tokens=int(enc.group(1)), prefill_s=float(enc.group(2)), new_tokens=int(dec.group(1)),
        decode_s=float(dec.group(2)), drafted=counters["n_drafted"], accepted=counters["n_accept"],
    )


def generated_text(stdout: str, prompt_text: str) -> str:
    """The text after the echoed prompt: the tool prints a blank line, the prompt's pieces, the new
    pieces (end-of-generation tokens left out), then a blank line."""
    start = stdout.find(prompt_text)
    if start < 0:
        raise RuntimeError(f"{TOOL}: its output does not echo the prompt; cannot find the generated text")
    text = stdout[start + len(prompt_text):]
    return text[:-2] if text.endswith("\n\n") else text


def parse_token_ids(stdout: str) -> list[int]:
    """``llama-tokenize --ids``: ``[1, 2, 3]`` on its last non-blank line."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    match = re.fullmatch(r"\s*\[([\d,\s]*)\]\s*", lines[-1]) if lines else None
    if match is None:
        raise RuntimeError(f"{TOKENIZE_TOOL}: no token id list in its output")
    return [int(t) for t in match.group(1).replace(",", " ").split()]


# ---------------------------------------------------------------------- agreement
def agreement(reference: Sequence[int], other: Sequence[int]) -> tuple[int, int]:
    """(tokens equal up to the first difference, the longer length): their ratio is the agreement."""
    n = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        n += 1
    return n, max(len(reference), len(other))


def agreement_rate(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Token-weighted agreement over prompts (1.0 when every pair is empty)."""
    same, total = map(sum, zip(*(agreement(r, o) for r, o in pairs))) if pairs else (0, 0)
    return same / total if total else 1.0


def strip_eos(tokens: Sequence[int], eos: Sequence[int]) -> list[int]:
    """Without a final end-of-sequence id (llama.cpp does not print it; our decoders keep it)."""
    return list(tokens[:-1]) if tokens and tokens[-1] in eos else list(tokens)


def canonical(tokenizer: Any, eos: Sequence[int]) -> Callable[[Sequence[int]], list[int]]:
    """Ids -> the ids of their text re-tokenised (final EOS dropped), so both sides of an agreement went
    through the same text -> ids step; the ids as they are where there is no tokenizer (random weights)."""
    if tokenizer is None:
        return lambda ids: strip_eos(ids, eos)

    def canon(ids: Sequence[int]) -> list[int]:
        text = tokenizer.decode(strip_eos(ids, eos), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return canon


# ---------------------------------------------------------------------- running it
def _run(argv: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} ran past {TIMEOUT_S} s") from exc
    if done.returncode != 0:
        tail = " | ".join(done.stderr.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {tail}")
    return done


@dataclass
class PeerSetup:
    variant: Variant
    target_gguf: Path
    draft_gguf: Path | None
    tokenizer: Any
    options: dict[str, str]
    threads: int
    checked: dict[tuple[int, ...], bool] = field(default_factory=dict)  # prompt ids -> llama.cpp reads the same


def prompt_ids_match(setup: PeerSetup, prompt: list[int], text: str) -> bool:
    """Whether llama.cpp tokenises ``text`` (BOS as the GGUF asks) into our ``prompt`` ids; once per prompt."""
    key = tuple(prompt)
    if key not in setup.checked:
        argv = [str(find_tool(TOKENIZE_TOOL)), "-m", str(setup.target_gguf), "-p", text, "--ids", "--no-escape",
                "--log-disable"]
        out = _run(argv, TOKENIZE_TOOL).stdout.decode("utf-8", "replace")
        setup.checked[key] = parse_token_ids(out) == prompt
    return setup.checked[key]


def tool_argv(setup: PeerSetup, text: str, n_prompt: int, cfg: GenerationConfig) -> list[str]:
    draft = str(setup.draft_gguf) if setup.draft_gguf else None
    ctx_len = n_prompt + cfg.max_new_tokens + 2 * DRAFT_N_MAX + 8
    return [
        str(find_tool()), "-m", str(setup.target_gguf), "-p", text, "--no-escape", "-n", str(cfg.max_new_tokens - 1),
        "--temp", "0", "--seed", "0", "-t", str(setup.threads), "-tb", str(setup.threads), "-c", str(ctx_len),
        "-b", str(max(2048, n_prompt)), "-ub", "512", *setup.variant.args(setup.options, draft, setup.threads),
    ]


def run_peer(setup: PeerSetup, prompt: list[int], cfg: GenerationConfig) -> PeerRun:
    """One prompt through the tool: tokens (re-tokenised), stats from its timers, notes."""
    if cfg.sampling.temperature > 0:
        raise MethodError("llama.cpp peers run greedy (temperature 0) only")
    text = setup.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    done = _run(tool_argv(setup, text, len(prompt), cfg), TOOL)
    report = parse_report(done.stderr.decode("utf-8", "replace"))
    if setup.variant.name == "llamacpp" and report.drafted:
        raise RuntimeError(f"{TOOL} drafted {report.drafted} tokens in the plain row; the prompt is too long for it")
    new_text = generated_text(done.stdout.decode("utf-8", "replace"), text)
    # its last round can run past the budget (a draft is not capped when one token is left): tok/s counts
    # every token it decoded over the time it took; the agreement reads the budget's worth
    tokens = list(setup.tokenizer(new_text, add_special_tokens=False)["input_ids"])[: cfg.max_new_tokens]
    stats = DecodeStats(
        new_tokens=report.new_tokens, wall_s=report.prefill_s + report.decode_s, prefill_s=report.prefill_s,
        drafted=report.drafted, accepted=report.accepted,
    )
    return PeerRun(tokens, stats, {"prompt_ids_match": prompt_ids_match(setup, prompt, text)})


def make_peer(name: str, target: Any, draft_name: str | None, options: dict[str, str], threads: int) -> PeerMethod:
    """The bench method ``name``: a runner of one prompt."""
    variant = VARIANTS[name]
    check_ready(name, target.name, draft_name)
    setup = PeerSetup(
        variant=variant, target_gguf=gguf_file(target.name),
        draft_gguf=gguf_file(draft_name) if variant.needs_draft and draft_name else None,
        tokenizer=target.tokenizer, options=options, threads=threads,
    )
    return lambda prompt, cfg: run_peer(setup, prompt, cfg)


def describe(name: str, target: str, draft: str | None) -> dict[str, Any]:
    """What the report says about a peer row."""
    variant = VARIANTS[name]
    files = [gguf_file(target).name] + ([gguf_file(draft).name] if variant.needs_draft and draft else [])
    return {
        "engine": f"llama.cpp ({llamacpp_version()}) {TOOL}", "variant": variant.describe, "gguf": files,
        "tokens_per_s": TIMING_NOTE, "text": "re-tokenised with our tokenizer for agree (the budget's worth)",
    }


def format_note(name: str, note: dict[str, Any]) -> str:
    """One line under the bench table for a peer row."""
    same = "yes" if note["prompt_ids_match"] else "NO (llama.cpp tokenised the prompt text differently)"
    return (
        f"{name}: {note['engine']}, {note['variant']}, on {' + '.join(note['gguf'])}; tok/s: {note['tokens_per_s']}; "
        f"text: {note['text']}; prompt ids as ours: {same}"
    )
