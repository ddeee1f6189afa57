"""The flags several commands (and tools/) share, declared once, and the parsers of flag values.

``add_model_args`` / ``add_prompt_args`` add the flags their table names, in the order asked, each
with the table's settings updated by the caller's changes (``limit={"default": 10}``): the commands
differ in defaults, required-ness and help, not in what a flag means.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import CliError

MODEL_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"required": True, "help": "target: alias, local directory or hub id"},
    "draft": {"help": "draft model of the same family (alias, directory or hub id)"},
    "precision": {"aliases": ("--dtype",), "default": "auto",
                  "help": "target arithmetic: float32 (CPU: oneDNN kernels; AUTOTUNE_FLOAT32_KERNEL=dense: identical to Hugging "
                          "Face float32), bfloat16, int8, int4 (weight-only, bf16 activations), w8a8 (int8 weights and "
                          "activations), gguf (the GGUF file's own blocks on llama.cpp's ggml kernels; `make kernels`), "
                          "or auto (int4, w8a8 or gguf on CPU, measured; bfloat16 on CUDA); speculation is lossless relative to plain decoding at the same "
                          "precision. --dtype is the same flag"},
    "device": {"default": "cpu"},
    "compile": {"action": "store_true",
                "help": "compile our decode steps (torch.compile fullgraph; CUDA graphs on CUDA); first steps pay the "
                        "compile"},
}
PROMPT_FLAGS: dict[str, dict[str, Any]] = {
    "prompt": {"help": "a single prompt (chat template applied when the model has one)"},
    "task": {"help": "task name: gsm8k, humaneval, mt-bench, prompts"},
    "data": {"help": "data file or folder for the task (default: $AUTOTUNE_DATA_DIR)"},
    "limit": {"type": int, "default": 5},
    "offset": {"type": int, "default": 0, "help": "skip this many prompts of the task"},
    "max_new_tokens": {"type": int, "default": 128},
}
STRATEGY_FLAGS: dict[str, dict[str, Any]] = {
    "draft_length": {"type": int, "help": "tokens drafted per round (strategy default if unset)"},
    "draft_precision": {"help": "draft arithmetic: auto, float32, bfloat16, int8, int4, w8a8, gguf (strategy default if unset)"},
    "draft_vocab": {"type": int, "help": "restrict the draft head to ids < N (0 = full head)"},
    "confidence_threshold": {"type": float, "help": "stop drafting below this top-1 probability"},
    "tree_widths": {"help": "draft a token tree: children per node at each depth, e.g. 4,2,2,1,1"},
    "dynamic_widths": {"help": "SWIFT dynamic verification table: 'swift' or P:K,P:K,... (last P = 1)"},
}


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: a flag whose default is a setting's reads it
    here, so the two cannot drift."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def add_flags(p: Any, table: Mapping[str, Mapping[str, Any]], names: Sequence[str] | None = None,
              changes: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Add ``--NAME`` for each of ``names`` (default: the whole ``table``, in order) to the parser or
    argument group ``p``, with ``table[NAME]`` updated by ``changes[NAME]``."""
    names = list(table) if names is None else list(names)
    changes = changes or {}
    unknown = sorted(set(names) - set(table))
    if unknown:  # a typo in a command's declaration, not user input
        raise ValueError(f"no shared flag {unknown[0]!r}; the table has {', '.join(table)}")
    unused = sorted(set(changes) - set(names))
    if unused:
        raise ValueError(f"changes to flag {unused[0]!r}, which is not added; adding {', '.join(names)}")
    for name in names:
        settings = {**table[name], **changes.get(name, {})}
        aliases = settings.pop("aliases", ())
        p.add_argument(f"--{name.replace('_', '-')}", *aliases, **settings)


def add_model_args(p: Any, names: Sequence[str] | None = None, **changes: Mapping[str, Any]) -> None:
    """``--model --draft --precision --device --compile`` (or ``names`` of them, in that order)."""
    add_flags(p, MODEL_FLAGS, names, changes)


def add_prompt_args(p: Any, names: Sequence[str] | None = None, **changes: Mapping[str, Any]) -> None:
    """``--prompt --task --data --limit --offset --max-new-tokens`` (or ``names`` of them)."""
    add_flags(p, PROMPT_FLAGS, names, changes)


def add_strategy_args(p: argparse.ArgumentParser) -> None:
    """The flags that build a strategy (:func:`autotune.cli.inputs.build_strategy`)."""
    add_flags(p, STRATEGY_FLAGS)


def int_list(flag: str, text: str) -> list[int]:
    """``"4,2,2"`` -> ``[4, 2, 2]``; anything else is a one-line error naming ``flag``."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated integers like 4,2,2,1,1, got {text!r}") from None


def width_table(text: str) -> list[list[float | int]]:
    """``--dynamic-widths``: ``swift`` (SWIFT's table) or ``P:K,P:K,...`` rows."""
    from search_spaces.strategy import SWIFT_DYNAMIC_WIDTHS

    if text == "swift":
        return [list(row) for row in SWIFT_DYNAMIC_WIDTHS]
    try:
        return [[float(p), int(k)] for p, k in (row.split(":") for row in text.split(","))]
    except ValueError:
        raise CliError(f"--dynamic-widths takes 'swift' or P:K pairs like 0.5:10,0.8:5,0.95:3,1:1, got {text!r}") from None
