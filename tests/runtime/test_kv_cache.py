import pytest
import torch

from runtime.kv_cache import KVCache
from runtime.transformer import CausalLM


def test_rollback_then_redecode_equals_fresh_prefill(tiny_llama):
    lm = CausalLM(tiny_llama)
    seq = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))
    cache = lm.new_cache(64)
    with torch.inference_mode():
        lm(seq[:12], cache)
        lm(torch.randint(0, 96, (5,)), cache)  # speculative rows that get rejected
        cache.rollback(12)
        redecoded = lm(seq[12:], cache)
        fresh_cache = lm.new_cache(64)
        fresh = lm(seq, fresh_cache)[12:]
    torch.testing.assert_close(redecoded, fresh, rtol=1e-5, atol=1e-5)
    for li in range(cache.n_layers):
        torch.testing.assert_close(cache.view(li)[0], fresh_cache.view(li)[0], rtol=1e-5, atol=1e-5)


def test_commit_gathers_path_rows_contiguously():
    cache = KVCache(n_layers=2, n_kv_heads=1, head_dim=2, capacity=10, dtype=torch.float32)
    rows = torch.arange(8, dtype=torch.float32)[None, :, None].expand(1, 8, 2)
    cache.write(0, rows, rows + 100)
    cache.write(1, rows, rows)
    cache.advance(8)
    cache.commit(start=3, path_indices=[0, 2, 4])
    assert cache.length == 6
    assert cache.view(0)[0][0, :, 0].tolist() == [0, 1, 2, 3, 5, 7]
    assert cache.view(0)[1][0, :, 0].tolist() == [100, 101, 102, 103, 105, 107]


def test_cache_refuses_overflow_and_bad_rollback():
    cache = KVCache(n_layers=1, n_kv_heads=1, head_dim=2, capacity=4, dtype=torch.float32)
    cache.advance(3)
    with pytest.raises(ValueError, match="full"):
        cache.advance(2)
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(5)
    with pytest.raises(ValueError, match="outside"):
        cache.commit(start=1, path_indices=[0, 5])
