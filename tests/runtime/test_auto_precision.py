"""``--precision auto`` on the CPU: int4, w8a8 or gguf, measured once per machine and kept."""
from __future__ import annotations

import json

import pytest

from runtime import auto_precision
from runtime.errors import RuntimeUserError
from runtime.precision import get_precision


@pytest.fixture
def unpinned(monkeypatch, tmp_path):
    monkeypatch.delenv(auto_precision.PIN_ENV, raising=False)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    return tmp_path / auto_precision.CACHE_FILE


def test_auto_is_the_faster_candidate_and_the_answer_is_kept(unpinned, monkeypatch):
    calls = []

    def probe():
        calls.append(1)
        return {"int4": 0.009, "w8a8": 0.004, "gguf": 0.02}

    monkeypatch.setattr(auto_precision, "probe", probe)
    assert get_precision("auto", "cpu").name == "w8a8"
    kept = json.loads(unpinned.read_text())
    (entry,) = kept.values()
    assert entry["precision"] == "w8a8" and entry["seconds"] == {"int4": 0.009, "w8a8": 0.004, "gguf": 0.02}
    assert get_precision("auto", "cpu").name == "w8a8" and len(calls) == 1  # read back, not probed again
    # another machine (here: another thread count) probes for itself
    monkeypatch.setattr(auto_precision, "cpu_fingerprint", lambda: "another machine")
    monkeypatch.setattr(auto_precision, "probe", lambda: {"int4": 0.003, "w8a8": 0.004, "gguf": 0.005})
    assert get_precision("auto", "cpu").name == "int4"
    assert set(json.loads(unpinned.read_text())) == {"another machine", *kept}


def test_a_broken_cache_file_is_probed_over(unpinned, monkeypatch):
    unpinned.write_text("{not json")
    monkeypatch.setattr(auto_precision, "probe", lambda: {"int4": 0.003, "w8a8": 0.004, "gguf": 0.005})
    assert auto_precision.cpu_auto_precision() == "int4"
    assert json.loads(unpinned.read_text())  # rewritten whole


def test_the_pin_decides_and_a_bad_pin_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(auto_precision, "probe", lambda: pytest.fail("a pinned choice must not probe"))
    monkeypatch.setenv(auto_precision.PIN_ENV, "w8a8")
    assert get_precision("auto", "cpu").name == "w8a8"
    monkeypatch.setenv(auto_precision.PIN_ENV, "float32")
    with pytest.raises(RuntimeUserError, match="AUTOTUNE_AUTO_PRECISION"):
        get_precision("auto", "cpu")


def test_auto_stays_bfloat16_off_the_cpu_and_float32_compiled_without_probing(unpinned, monkeypatch):
    monkeypatch.setattr(auto_precision, "probe", lambda: pytest.fail("nothing here needs the probe"))
    assert get_precision("auto", "cuda").name == "bfloat16"
    assert get_precision("auto", "cpu", compiled=True).name == "float32"  # quantised kernels do not compile


def test_the_probe_times_both_candidates_on_this_machine():
    seconds = auto_precision.probe()
    assert set(seconds) == set(auto_precision.CANDIDATES) and all(s > 0 for s in seconds.values())


def test_a_kept_answer_without_a_candidate_is_probed_again(unpinned, monkeypatch):
    """An answer kept before gguf was a candidate (or before its kernels were built) did not time
    it: it is probed again, and gguf wins where it is faster."""
    from runtime.machine import cpu_fingerprint

    unpinned.write_text(json.dumps({cpu_fingerprint(): {"precision": "w8a8", "seconds": {"int4": 0.009, "w8a8": 0.004}}}))
    monkeypatch.setattr(auto_precision, "probe", lambda: {"int4": 0.009, "w8a8": 0.004, "gguf": 0.002})
    assert auto_precision.cpu_auto_precision() == "gguf"


def test_the_choice_is_explained_with_the_probe_times(unpinned, monkeypatch):
    """The study's and the server's words for a precision: auto's measured times where auto chose it."""
    monkeypatch.setattr(auto_precision, "probe", lambda: {"int4": 0.045, "w8a8": float("inf"), "gguf": 0.028})
    assert auto_precision.cpu_auto_precision() == "gguf"
    text = auto_precision.explain("gguf")
    assert text.startswith("gguf (auto on this CPU") and "int4 45 ms" in text and "w8a8 unavailable" in text
    assert auto_precision.explain("int4", asked="int4") == "int4 (--precision int4)"
