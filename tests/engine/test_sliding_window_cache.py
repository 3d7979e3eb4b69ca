"""A hybrid model's sliding-window KV in the engine's cache: a hit needs its trailing window,
is shortened to where it has one, and what a request leaves in L1 and L2 of the sliding layers
is bounded by the window whatever the prompt's length."""
from __future__ import annotations

import pytest
import torch
from test_scheduler import assert_no_leaks, make_cache, toks

from kvtier.engine import Engine, SamplingParams

PAGE = 16
WINDOW_PAGES = 3  # tiny_hybrid_config's 40-token window over 16-token pages
PARAMS = SamplingParams(max_new_tokens=4)


def _engine(model, device_pages: int = 128):
    return Engine(model, make_cache(model, device_pages, page=PAGE), owns_cache=True,
                  deterministic=True)


def test_a_hit_whose_window_lost_its_sliding_kv_is_shortened_to_where_it_has_it(
        tiny_hybrid_models) -> None:
    model = tiny_hybrid_models[torch.float32]
    prompt = toks(10 * PAGE, seed=21)
    short = prompt[:6 * PAGE]
    with _engine(model) as eng:
        cold = eng.generate([prompt], PARAMS)[0]
    with _engine(model) as eng:
        eng.generate([short], PARAMS)  # keeps sliding KV of pages 2-5 (where it resumes)
        eng.generate([prompt], PARAMS)  # ... of pages 6-9
        full = eng.generate([prompt], PARAMS)[0]
        assert full.cached.device == 9 * PAGE  # the whole prompt but its last page
        cache = eng.cache
        lookup = cache.lookup(prompt)
        pages = lookup.device_pages
        cache.abort(lookup)
        assert cache.device_pool.sidecar.release([pages[8]]) == 1  # inside the last window
        shortened = eng.generate([prompt], PARAMS)[0]
        assert shortened.cached.device == 8 * PAGE  # pages 5-7 still have it
        lookup = cache.lookup(prompt)
        cache.abort(lookup)
        cache.device_pool.sidecar.release([pages[6]])  # now no window before page 9 has it
        assert eng.generate([prompt], PARAMS)[0].cached.device == 6 * PAGE  # pages 3-5 do
        eng.cache.flush()
        assert_no_leaks(eng.cache)
    for hit in (full, shortened):
        assert hit.tokens == cold.tokens
        assert torch.equal(hit.prefill_logits, cold.prefill_logits)


def _left_behind(model, prompt) -> tuple[int, int, int]:
    """(full pages, L1 sidecar slots, L2 sidecar slots) one cold request leaves in a cache."""
    with _engine(model, device_pages=256) as eng:
        eng.generate([prompt], PARAMS)
        cache = eng.cache
        cache.flush()  # write-through copies landed
        assert_no_leaks(cache)
        return (cache.device_pool.allocator.num_used, cache.device_pool.sidecar.used_slots,
                cache.host_pool.sidecar.used_slots)


def test_sliding_kv_left_per_request_is_bounded_by_the_window(tiny_hybrid_models) -> None:
    model = tiny_hybrid_models[torch.float32]
    short = _left_behind(model, toks(8 * PAGE, seed=31))
    long = _left_behind(model, toks(64 * PAGE, seed=32))
    assert long[0] >= 64 > short[0]  # full layers: every page
    for _, l1_slots, l2_slots in (short, long):
        # the window where a resend resumes and the one at its end (one page apart here)
        assert 0 < l1_slots <= 2 * WINDOW_PAGES + 1 and 0 < l2_slots <= 2 * WINDOW_PAGES + 1
    assert long[1:] == short[1:]  # whatever the length


def test_a_forward_never_reads_a_page_whose_sliding_kv_is_gone(tiny_hybrid_models) -> None:
    from kvtier.engine import ModelRunner
    from kvtier.errors import AllocatorError
    from kvtier.tiers.device_pool import DevicePool

    model = tiny_hybrid_models[torch.float32]
    prompt = toks(4 * PAGE, seed=41)
    with DevicePool(model.kv_spec(PAGE), 8, device="cpu") as pool:
        runner = ModelRunner(model, pool, PAGE)
        pages = [0, 1, 2, 3, 4]
        runner.prefill(prompt, 0, pages)
        runner.decode([1], [(pages, len(prompt))])  # reads pages 1-3: in the window
        assert pool.sidecar.release([pages[2]]) == 1
        with pytest.raises(AllocatorError, match="no sliding-window KV"):
            runner.decode([1], [(pages, len(prompt) + 1)])
