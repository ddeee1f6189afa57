"""Study reports and bench plots (``autotune.reports.plots``, ``autotune report``, ``bench --plot``).

The study tests run one short real study on SmolLM2 (slow tier) and render it through the library
and through the CLI; the bench plot and the CLI's error cases need no model.
"""
from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.reports.plots import STUDY_PLOTS, bench_plot, predicted_vs_measured, write_study_report
from autotune.reports.study_report import safe_dir_names
from autotune.store.storage import open_storage
from tests.helpers import assert_one_line_error, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALWAYS = ("tuning_curve.png", "predicted_vs_measured.png")
HELD_OUT = ("held_out.png",)  # a study made since held-out judging
FROM_STATS = ("acceptance_by_position.png", "accepted_histogram.png")


def assert_png(path: Path, min_bytes: int = 5_000) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > min_bytes, (path, len(data))
    height, width = imread(str(path)).shape[:2]
    assert width >= 400 and height >= 200, (path, width, height)


# ---------------------------------------------------------------------- a real study
@pytest.fixture(scope="module")
def studied(tmp_path_factory) -> tuple[str, str]:
    """A short layer-skip study of SmolLM2 on two HumanEval prompts: (storage URL, study name)."""
    from autotune.tuning.study import run_study
    from autotune.tuning.tuner import TunerSettings
    from runtime.decoding import GenerationConfig
    from runtime.pipeline import ModelPool, eos_ids
    from studies import encode_prompt, load_prompts

    url = f"sqlite:///{tmp_path_factory.mktemp('plots') / 'study.db'}"
    pool = ModelPool()
    target = pool.get("smollm2-135m", "float32")
    prompts = [encode_prompt(p, target.tokenizer) for p in load_prompts("humaneval", limit=2)]
    cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=eos_ids(target))
    settings = TunerSettings(window=16, beta=8, max_share=1.0, max_trials=20, patience=20)
    start = time.perf_counter()
    with open_storage(url) as storage:
        report = run_study(pool, target, None, "humaneval", prompts, cfg, storage, "layer-skip", settings,
                           progress=False)
        study = optuna.load_study(study_name=report.name, storage=storage.optuna_storage())
        if "tune_stats" not in study.user_attrs:  # until `autotune study` stores it itself
            study.set_user_attr("tune_stats", report.tune_stats.as_dict())
    print(f"study: {time.perf_counter() - start:.1f} s, {report.tuner['trials']} trials", file=sys.stderr)
    return url, report.name


def load(url: str, name: str) -> optuna.Study:
    with open_storage(url) as storage:
        return optuna.load_study(study_name=name, storage=storage.optuna_storage())


def assert_report_dir(out: Path, expect: tuple[str, ...]) -> None:
    page = (out / "index.html").read_text()
    for name in expect:
        assert_png(out / name)
        assert f'src="{name}"' in page, name


@pytest.mark.slow
def test_study_report_has_every_plot(studied, tmp_path):
    url, name = studied
    study = load(url, name)
    index = write_study_report(study, tmp_path / "report")
    assert index == tmp_path / "report" / "index.html"
    expect = ALWAYS + HELD_OUT + (FROM_STATS if study.user_attrs.get("tune_stats") else ())
    assert_report_dir(index.parent, expect)
    page = index.read_text()
    assert f"<title>{name.replace('&', '&amp;')}</title>" in page  # study names hold no < > "
    assert "Kept strategies" in page and "<td>" in page


@pytest.mark.slow
def test_study_report_without_tune_stats_lists_the_skipped_plots(studied, tmp_path):
    url, name = studied
    study = optuna.create_study(study_name="copy", storage=optuna.storages.InMemoryStorage())
    study.add_trials(load(url, name).trials)  # the trials and the kept list, no tune_stats
    study.set_user_attr("kept", load(url, name).user_attrs.get("kept", []))
    index = write_study_report(study, tmp_path / "bare")
    assert_report_dir(tmp_path / "bare", ALWAYS)
    page = index.read_text()
    for name in FROM_STATS + HELD_OUT:
        assert not (tmp_path / "bare" / name).exists()
        assert f"<li>{name}: " in page


@pytest.mark.slow
def test_report_cli_one_study_and_all_studies(studied, tmp_path, capsys):
    url, name = studied
    code, out, err = run(capsys, "report", name, "--storage", url, "--out", str(tmp_path / "one"))
    assert code == 0, err
    assert out.strip() == f"plots: {tmp_path / 'one' / 'index.html'}"
    assert_report_dir(tmp_path / "one", ALWAYS + FROM_STATS)
    # every study: one safe sub-directory each, linked from a top-level index
    code, out, err = run(capsys, "report", "--storage", url, "--out", str(tmp_path / "all"))
    assert code == 0, err
    sub = safe_dir_names([name])[name]
    assert "|" not in sub and "+" not in sub and ":" not in sub
    assert_report_dir(tmp_path / "all" / sub, ALWAYS + FROM_STATS)
    assert f'href="{sub}/index.html"' in (tmp_path / "all" / "index.html").read_text()


@pytest.mark.slow
def test_optuna_dashboard_lists_the_study(studied):
    dashboard = pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (test extra)")
    url, name = studied
    app = dashboard.wsgi(url)
    environ = {
        "REQUEST_METHOD": "GET", "PATH_INFO": "/api/studies", "QUERY_STRING": "", "SERVER_NAME": "localhost",
        "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(),
        "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0), "wsgi.multithread": False,
        "wsgi.multiprocess": False, "wsgi.run_once": False,
    }
    seen = {}

    def start_response(status, headers, exc_info=None):
        seen["status"] = status

    body = b"".join(app(environ, start_response))
    assert seen["status"].startswith("200"), seen
    listed = json.loads(body)
    studies = listed.get("studies", listed.get("study_summaries"))  # the dashboard's key is to be renamed
    assert name in [s["study_name"] for s in studies]


# ---------------------------------------------------------------------- no model needed
def test_report_cli_errors_write_nothing(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    out = tmp_path / "out"
    code, _, err = run(capsys, "report", "--storage", url, "--out", str(out))
    assert_one_line_error(code, err, "no studies in", "autotune study")
    with open_storage(url) as storage:
        optuna.create_study(study_name="m+d|humaneval|easyspec|cpu", storage=storage.optuna_storage())
    code, _, err = run(capsys, "report", "nope", "--storage", url, "--out", str(out))
    assert_one_line_error(code, err, "no study named 'nope'", "'m+d|humaneval|easyspec|cpu'")
    assert not out.exists()
    code, _, err = run(capsys, "report", "--storage", url)  # --out is required
    assert code == 2 and "--out" in err


def test_a_study_with_no_trials_still_renders(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_storage(url) as storage:
        optuna.create_study(study_name="m|t|s|cpu", storage=storage.optuna_storage())
    code, _, err = run(capsys, "report", "m|t|s|cpu", "--storage", url, "--out", str(tmp_path / "out"))
    assert code == 0, err
    page = (tmp_path / "out" / "index.html").read_text()
    for name in ALWAYS:
        assert (tmp_path / "out" / name).read_bytes().startswith(PNG_MAGIC)
        assert f'src="{name}"' in page
    assert "tune_stats" in page  # the skipped plots say why


def test_safe_dir_names_are_distinct():
    names = ["a|b", "a+b", "smollm2-135m@gguf:b179c|humaneval|layer-skip|cpu", "|||"]
    dirs = safe_dir_names(names)
    assert len(set(dirs.values())) == len(names)
    assert all(d and all(c.isalnum() or c in "._-" for c in d) for d in dirs.values())
    assert dirs[names[2]] == "smollm2-135m_gguf_b179c_humaneval_layer-skip_cpu"


def test_predicted_vs_measured_with_no_measurement(tmp_path):
    kept = [{"trial": 0, "strategy": {"drafter": "layer-skip", "draft_length": 4}, "predicted_tps": 20.0,
             "measured_tps": None, "matchness": 0.5, "tokens": 0}]
    assert_png(predicted_vs_measured(kept, tmp_path / "pvm.png"))


def test_bench_plot(tmp_path):
    def method(tps, speedup, identical=True, alpha=None):
        return {"tokens_per_s": tps, "speedup_vs_baseline": speedup, "acceptance_rate": alpha,
                "identical_to_baseline": identical}

    report = {
        "baseline": "hf",
        "methods": {"hf": method(18.0, 1.0), "vanilla": method(17.0, 0.94), "sd": method(24.0, 1.33, alpha=0.7),
                    "selfspec:r0.3": method(15.5, 0.86, identical=False, alpha=0.4)},
        "config": {"model": "smollm2-135m", "task": "humaneval"},
    }
    assert_png(bench_plot(report, tmp_path / "bench.png"))


def test_registry_names_its_files():
    assert {p.file for p in STUDY_PLOTS.values()} == set(ALWAYS + FROM_STATS + HELD_OUT)
    assert all(p.file == f"{key}.png" for key, p in STUDY_PLOTS.items())


@pytest.mark.slow
@pytest.mark.heavy  # a whole study through the CLI (about 50 s); the report's plots are tested above
def test_study_cli_plot_flag(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    out = tmp_path / "plots"
    code, stdout, err = run(capsys, "study", "--model", "smollm2-135m", "--task", "humaneval", "--limit", "1",
                            "--max-new-tokens", "24", "--window", "8", "--trials", "4", "--max-share", "1.0",
                            "--storage", url, "--plot", str(out))
    assert code in (0, 1), err  # 1: the tuned strategy was refused (its table is printed all the same)
    assert stdout.strip().splitlines()[-1] == f"plots: {out / 'index.html'}"
    assert_report_dir(out, ALWAYS)


def test_held_out_spread_plot(tmp_path):
    """The held-out judgement's strip plot, from a study's `heldout` attribute alone."""
    from autotune.reports.plots import held_out_spread

    chain = {"drafter": "draft-model", "draft_length": 4}
    heldout = {"chosen": "runner-up", "prompts": 5, "in_sample": False, "candidates": [
        {"label": "plain", "strategy": {}, "speedups": [1.0] * 5, "speedup": 1.0, "bound": 0.0},
        {"label": "incumbent", "strategy": {"drafter": "prompt-lookup", "draft_length": 12}, "identical": True,
         "speedups": [2.1, 0.8, 0.9, 1.9, 0.7], "speedup": 1.2, "bound": -0.2},
        {"label": "runner-up", "strategy": chain, "identical": True, "speedups": [1.2, 1.3, 1.25, 1.2, 1.3],
         "speedup": 1.25, "bound": 0.2},
    ]}
    assert_png(held_out_spread(heldout, tmp_path / "h.png"))
    assert_png(held_out_spread({"prompts": 1, "candidates": [heldout["candidates"][0]]}, tmp_path / "p.png"))
