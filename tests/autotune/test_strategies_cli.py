"""`autotune strategies list|show|delete|export` and `generate --strategy best|default|PATH`.

Everything runs on a temporary SQLite store; `generate` cases must fail before any model loads.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from autotune.errors import StorageError
from autotune.store.resolve import load_strategy_file, resolve_strategy, strategy_key
from autotune.store.storage import StrategyKey, open_storage
from search_spaces.errors import StrategyError
from search_spaces.strategy import PLAIN, Strategy
from tests.helpers import HW, IDS, STORED, STORED_MODEL, assert_one_line_error, run, snapshot, stored_key


# ---------------------------------------------------------------------- list / show / delete
def test_list_text_and_json(url, capsys):
    code, out, _ = run(capsys, "strategies", "list", "--storage", url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["id", "model", "draft", "task"] and len(lines) == 1 + len(STORED)
    assert "prompt-lookup k=7" in out and "plain" in out
    code, out, _ = run(capsys, "strategies", "list", "--storage", url, "--json")
    rows = json.loads(out)
    assert [r["id"] for r in rows] == list(IDS.values())
    assert rows[1]["strategy"] == STORED["lookup"][2].to_dict() and rows[1]["key"]["hardware"] == HW


def test_list_filters(url, capsys):
    _, out, _ = run(capsys, "strategies", "list", "--storage", url, "--json", "--task", "gsm8k")
    assert [r["id"] for r in json.loads(out)] == [IDS["lookup"], IDS["tree"]]
    _, out, _ = run(capsys, "strategies", "list", "--storage", url, "--json", "--model", "smollm2-135m")
    assert len(json.loads(out)) == len(STORED)  # the alias before '@' matches
    _, out, _ = run(capsys, "strategies", "list", "--storage", url, "--json", "--model", "llama3-8b")
    assert json.loads(out) == []


def test_show(url, capsys):
    code, out, _ = run(capsys, "strategies", "show", str(IDS["draft"]), "--storage", url, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["history_count"] == 1 and shown["key"]["draft_id"] == "smollm2-135m"
    assert Strategy.from_dict(shown["strategy"]) == STORED["draft"][2]
    code, out, _ = run(capsys, "strategies", "show", str(IDS["draft"]), "--storage", url)
    assert code == 0 and "task: humaneval" in out and '"draft_vocab": 32768' in out


def test_delete_keeps_history(url, capsys):
    code, out, _ = run(capsys, "strategies", "delete", str(IDS["lookup"]), "--storage", url)
    assert code == 0 and f"deleted strategy {IDS['lookup']}" in out
    with open_storage(url) as storage:
        assert storage.get(IDS["lookup"]) is None and len(storage.list_best()) == len(STORED) - 1
        assert len(storage.history(stored_key("", "gsm8k"))) == 1


# ---------------------------------------------------------------------- export
def test_export_json_reads_back_as_a_strategy_file(url, capsys, tmp_path):
    out_file = tmp_path / "out" / "s.json"
    code, out, _ = run(capsys, "strategies", "export", str(IDS["groups"]), "--storage", url, "--output", str(out_file))
    assert code == 0 and out == ""
    assert load_strategy_file(out_file) == STORED["groups"][2]
    code, out, _ = run(capsys, "strategies", "export", str(IDS["tree"]), "--storage", url, "--json")
    assert Strategy.from_json(out) == STORED["tree"][2]


@pytest.mark.parametrize("name,fmt,expected", [
    ("draft", "hf", {"assistant_model": "smollm2-135m", "num_assistant_tokens": 6,
                     "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.5}),
    ("draft", "vllm", {"model": "smollm2-135m", "num_speculative_tokens": 6}),
    ("lookup", "hf", {"prompt_lookup_num_tokens": 7, "max_matching_ngram_size": 8}),
    ("lookup", "vllm", {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 8, "prompt_lookup_min": 2}),
    ("plain", "hf", {}),
    ("plain", "vllm", None),
])
def test_export_engine_configs(url, capsys, name, fmt, expected):
    code, out, err = run(capsys, "strategies", "export", str(IDS[name]), "--storage", url, "--format", fmt, "--json")
    assert code == 0 and json.loads(out) == expected
    if name == "draft":  # speed-only settings the engine lacks are named on stderr
        assert "draft_vocab=32768" in err
    if (name, fmt) == ("lookup", "hf"):  # HF copies after any match down to one token
        assert "no minimum matching n-gram (ours: 2" in err


@pytest.mark.parametrize("name,needle", [
    ("selfskip", "drafter 'layer-skip'"), ("tree", "token trees"), ("groups", "parallel layer groups"),
    ("dynamic", "dynamic_widths"),
])
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
def test_export_refuses_what_engines_cannot_express(url, capsys, name, needle, fmt):
    code, out, err = run(capsys, "strategies", "export", str(IDS[name]), "--storage", url, "--format", fmt)
    assert_one_line_error(code, err, f"cannot be exported as {fmt}", needle)
    assert out == ""


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv,needles", [
    (["strategies", "delete", "99"], ["no stored strategy with id 99", "strategies list"]),
    (["strategies", "show", "99"], ["no stored strategy with id 99"]),
    (["strategies", "export", "99", "--format", "hf"], ["no stored strategy with id 99"]),
    (["strategies", "export", "1", "--format", "xml"], ["invalid choice: 'xml'"]),
    (["strategies", "delete", "one"], ["invalid int value"]),
])
def test_bad_ids_leave_the_store_untouched(url, capsys, argv, needles):
    before = snapshot(url)
    code, _, err = run(capsys, *argv, "--storage", url)
    assert_one_line_error(code, err, *needles)
    assert snapshot(url) == before


@pytest.mark.parametrize("storage,needle", [
    ("postgresql://x@127.0.0.1:1/db", "cannot open storage postgresql://x@127.0.0.1:1/db"),
    ("::not a url::", "malformed"),
    ("nosuchdb://x/y", "unknown database driver"),
])
@pytest.mark.parametrize("command", [["strategies", "list"], ["strategies", "delete", "1"]])
def test_bad_storage_urls(url, capsys, storage, needle, command, tmp_path):
    before = snapshot(url)
    code, _, err = run(capsys, *command, "--storage", storage)
    assert_one_line_error(code, err, needle)
    assert snapshot(url) == before
    assert all(p.name.startswith("store.db") for p in tmp_path.iterdir())  # nothing else created


# ---------------------------------------------------------------------- generate --strategy
def generate(capsys, *extra: str) -> tuple[int, str, str]:
    return run(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi", *extra)


def test_generate_corrupt_strategy_file(capsys, tmp_path, no_model_loads):
    bad = tmp_path / "bad.json"
    bad.write_text('{"drafter": "draft-model", "draft_length": ')
    assert_one_line_error(*generate(capsys, "--strategy", str(bad))[::2], f"strategy file {bad}", "not valid JSON")
    bad.write_text('{"draft_length": 999}')
    assert_one_line_error(*generate(capsys, "--strategy", str(bad))[::2], "draft_length=999")
    missing = tmp_path / "missing.json"
    assert_one_line_error(*generate(capsys, "--strategy", str(missing))[::2], f"cannot read strategy file {missing}")


def test_generate_best_with_nothing_stored(capsys, tmp_path, url, no_model_loads):
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    code, _, err = generate(capsys, "--strategy", "best", "--storage", empty)
    assert_one_line_error(code, err, "no tuned strategy stored for model smollm2-135m task prompts", "autotune study")
    # stored for other tasks / drafts only
    code, _, err = generate(capsys, "--strategy", "best", "--storage", url, "--draft", "other-draft")
    assert_one_line_error(code, err, "no tuned strategy stored", "draft other-draft")


def test_generate_best_with_unreachable_storage(capsys, no_model_loads):
    code, _, err = generate(capsys, "--strategy", "best", "--storage", "postgresql://x@127.0.0.1:1/db")
    assert_one_line_error(code, err, "cannot open storage")


def test_generate_strategy_and_strategy_flags_conflict(capsys, no_model_loads):
    code, _, err = generate(capsys, "--strategy", "default", "--draft-length", "3", "--tree-widths", "1,1,1")
    assert_one_line_error(code, err, "--strategy replaces the strategy flags", "--draft-length", "--tree-widths")


# ---------------------------------------------------------------------- resolve_strategy
def test_resolve_default_best_and_path(url, tmp_path):
    target = SimpleNamespace(model_id=STORED_MODEL, revision="b179c9523d0e")
    k = strategy_key(target, "smollm2-135m", "humaneval", "cpu")
    assert k == stored_key("smollm2-135m", "humaneval")
    fallback = Strategy(draft_length=2)
    assert resolve_strategy("default", url, k, fallback) == fallback
    assert resolve_strategy("best", url, k, fallback) == STORED["draft"][2]
    with open_storage(url) as storage:  # an open store works too
        assert resolve_strategy("best", storage, strategy_key(target, None, "gsm8k", "cpu"), fallback) == STORED[
            "lookup"][2]
    path = tmp_path / "s.json"
    path.write_text(STORED["selfskip"][2].to_json())
    assert resolve_strategy(str(path), None, k, fallback) == STORED["selfskip"][2]


def test_resolve_best_missing_names_model_and_task(url):
    k = StrategyKey("other-model", "main", "", "gsm8k", HW)
    with pytest.raises(StorageError, match="no tuned strategy stored for model other-model task gsm8k"):
        resolve_strategy("best", url, k, PLAIN)


def test_resolve_corrupt_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("[1, 2]")
    with pytest.raises(StrategyError, match="must be a JSON object"):
        resolve_strategy(str(path), None, stored_key("", "gsm8k"), PLAIN)


def test_chosen_strategy_replaces_the_flags(url):
    from autotune.cli.inputs import chosen_strategy as _chosen_strategy
    from autotune.cli.main import build_parser

    args = build_parser().parse_args(
        ["generate", "--model", "smollm2-135m", "--task", "gsm8k", "--strategy", "best", "--storage", url])
    target = SimpleNamespace(model_id=STORED_MODEL, revision="b179c9523d0e")
    assert _chosen_strategy(args, target, PLAIN) == STORED["lookup"][2]


def test_runtime_rejects_a_plan_for_another_depth(tiny_llama):
    from runtime.errors import RuntimeUserError
    from runtime.loading import LoadedModel
    from runtime.pipeline import ModelPool, build_decoder

    target = LoadedModel(name="tiny", model_id="tiny", revision="0", hf_model=tiny_llama, tokenizer=None)
    with pytest.raises(RuntimeUserError, match="30 layers"):
        build_decoder(ModelPool(), target, STORED["selfskip"][2], None)


@pytest.mark.heavy  # measures a batch schedule on SmolLM2 (about 30 s); the export's format is tested above
def test_vllm_export_with_a_batch_schedule_measured_here(tmp_path, capsys):
    """A stored draft-model chain for SmolLM2 on this machine: the export times steps with random
    weights and adds vLLM's schedule; another machine's strategy is refused."""
    from autotune.cli.main import main
    from autotune.store.records import ResultMetrics

    url = f"sqlite:///{tmp_path / 'store.db'}"
    chain = Strategy(draft_length=4, draft_precision="int8")
    with open_storage(url) as storage:
        here = storage.record(stored_key("smollm2-135m", "t"), chain, ResultMetrics.from_throughput(10.0, acceptance=0.7))
        there = storage.record(StrategyKey(STORED_MODEL, "b179c9523d0e", "smollm2-135m", "t", "another machine"),
                               chain, ResultMetrics.from_throughput(10.0, acceptance=0.7))
        ids = {b.history_id: b.id for b in storage.list_best()}
    assert main(["strategies", "export", str(ids[here]), "--format", "vllm", "--batch-schedule", "--storage", url]) == 0
    payload = json.loads(capsys.readouterr().out)
    schedule = payload["num_speculative_tokens_per_batch_size"]
    assert payload["num_speculative_tokens"] == 4 and list(schedule)[0].startswith("1-")
    assert all(0 <= k <= 4 for k in schedule.values())
    assert main(["strategies", "export", str(ids[there]), "--format", "vllm", "--batch-schedule", "--storage", url]) == 2
    assert "only transfers to the hardware" in capsys.readouterr().err
