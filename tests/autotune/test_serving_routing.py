"""Which strategy the server decodes a request with (autotune.serving.routing.book), on a real store
(SQLite) and real task prompts; no model is loaded: the book only needs the served model's id."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune.serving.metrics import ServingMetrics
from autotune.serving.protocol import ApiError
from autotune.serving.routing.book import StrategyBook
from autotune.store.hardware import hardware_fingerprint
from autotune.store.records import ResultMetrics, StrategyKey
from autotune.store.storage import open_storage
from search_spaces.layer_plan import uniform_skip_plan
from search_spaces.strategy import PLAIN, Strategy
from tests.helpers import routing_texts

TARGET = SimpleNamespace(model_id="org/served-model", revision="abc")
SKIP = Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(30, 0.2))
LOOKUP = Strategy(drafter="prompt-lookup", draft_length=6)


def key(task: str, model: str = "org/served-model") -> StrategyKey:
    return StrategyKey(model_id=model, model_revision="abc", draft_id="", task=task, hardware=hardware_fingerprint("cpu"))


@pytest.fixture()
def storage(tmp_path):
    with open_storage(f"sqlite:///{tmp_path / 'book.db'}") as s:
        yield s


def book_with(storage, **stored: Strategy) -> StrategyBook:
    for task, strategy in stored.items():
        storage.record(key(task), strategy, ResultMetrics.from_throughput(10.0), prompts=routing_texts(task))
    book = StrategyBook(storage, TARGET, None, "cpu", ServingMetrics())
    book.refresh()
    return book


def test_auto_routes_each_task_to_its_strategy_and_the_rest_to_plain(storage):
    book = book_with(storage, gsm8k=SKIP, humaneval=LOOKUP)
    for task, strategy in (("gsm8k", SKIP), ("humaneval", LOOKUP)):
        for text in routing_texts(task, 5, offset=30):  # prompts the store was not given
            choice = book.choose(text, "auto")
            assert (choice.route, choice.strategy) == (task, strategy)
            assert choice.distance < book.router.threshold
    far = book.choose("Write a haiku about autumn leaves falling on a quiet pond.", "auto")
    assert (far.route, far.strategy, far.label) == ("unknown", PLAIN, "plain")


def test_unknown_uses_a_stored_general_purpose_strategy(storage):
    book = book_with(storage, gsm8k=SKIP)
    storage.record(key("prompts"), LOOKUP, ResultMetrics.from_throughput(12.0))  # no prompts: not routable
    assert book.refresh_if_changed()
    far = book.choose("Write a haiku about autumn leaves falling on a quiet pond.", "auto")
    assert (far.route, far.strategy) == ("unknown", LOOKUP) and far.label != "plain"
    assert not book.refresh_if_changed()  # nothing changed since


def test_unknown_starts_on_the_fallback_the_server_chose(storage):
    """With a draft and no general entry, ``unknown`` decodes with the book's fallback: plain
    decoding until the server measured that its default draft pays (``DecodeWorker.unknown_start``);
    a stored general entry still comes first."""
    from dataclasses import replace

    storage.record(replace(key("gsm8k"), draft_id="org/draft"), SKIP, ResultMetrics.from_throughput(10.0),
                   prompts=routing_texts("gsm8k"))
    book = StrategyBook(storage, TARGET, "org/draft", "cpu", ServingMetrics())
    book.refresh()
    haiku = "Write a haiku about autumn leaves falling on a quiet pond."
    assert (book.choose(haiku, "auto").strategy, book.choose(haiku, "auto").label) == (PLAIN, "plain")
    assert book.describe()[-1] == "unknown -> plain"
    book.use_fallback(book.default)
    assert book.describe()[-1] == "unknown -> default"
    far = book.choose(haiku, "auto")
    assert (far.route, far.strategy, far.label) == ("unknown", Strategy(), "default")
    assert book.choose(routing_texts("gsm8k", 1, offset=40)[0], "auto").strategy == SKIP  # routed as before
    assert 'route="unknown",strategy="default"' in book.metrics.render().decode()
    storage.record(replace(key("prompts"), draft_id="org/draft"), LOOKUP, ResultMetrics.from_throughput(12.0))
    assert book.refresh_if_changed() and book.choose(haiku, "auto").strategy == LOOKUP


def test_overrides_bypass_routing(storage):
    book = book_with(storage, gsm8k=SKIP)
    math = routing_texts("gsm8k", 1, offset=40)[0]
    assert book.choose(math, "plain").strategy == PLAIN
    assert book.choose(math, "default").strategy == PLAIN  # no draft: the default is plain decoding
    (row,) = storage.list_best(task="gsm8k")
    by_id = book.choose("anything", str(row.id))
    assert (by_id.route, by_id.strategy, by_id.label) == ("id", SKIP, str(row.id))


def test_unknown_or_foreign_strategy_id_is_a_400(storage):
    book = book_with(storage, gsm8k=SKIP)
    with pytest.raises(ApiError) as err:
        book.choose("x", "9999")
    assert err.value.status == 400 and err.value.code == "unknown_strategy"
    storage.record(key("gsm8k", model="org/other-model"), SKIP, ResultMetrics.from_throughput(9.0))
    (row,) = [r for r in storage.list_best(task="gsm8k") if r.key.model_id == "org/other-model"]
    with pytest.raises(ApiError) as err:
        book.choose("x", str(row.id))
    assert err.value.status == 400 and err.value.code == "strategy_mismatch"
    assert "org/other-model" not in err.value.message  # another key's model is not the client's business


def test_metrics_name_the_strategy_of_every_route(storage):
    book = book_with(storage, gsm8k=SKIP, humaneval=LOOKUP)
    lines = [ln for ln in book.metrics.render().decode().splitlines() if ln.startswith("autotune:route_strategy_info{")]
    (row,) = [r for r in book.storage.list_best(task="gsm8k")]
    assert any('route="gsm8k"' in ln and f'strategy="{row.id}"' in ln for ln in lines)
    assert any('route="humaneval"' in ln for ln in lines)
    assert any('route="unknown"' in ln and 'strategy="plain"' in ln for ln in lines)
