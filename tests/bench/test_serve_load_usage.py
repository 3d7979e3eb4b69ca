"""The load's cached-token figures from the standard usage field: `cached_tokens_reported`,
`cached_prompt_tokens` and `hit_rate_after_round1`, null (not 0) where the server does not
report them."""
from __future__ import annotations

import json

import pytest

from kvtier.bench.serve_load import (RequestRecord, StreamResult, answered_record, compare,
                                     failed_record, summarize)


def answered(client: int, round_: int, prompt: int, cached: int | None,
             by_tier: dict | None = None) -> RequestRecord:
    return RequestRecord(client, round_, True, 0.1, 0.2, prompt, 4, cached, by_tier)


def test_hit_rate_after_round1_counts_rounds_two_and_later() -> None:
    tiers = {"device": 10, "host": 0, "storage": 0}
    records = [answered(0, 0, 1000, 64, tiers), answered(0, 1, 1100, 1000, tiers),
               answered(0, 2, 1200, 1100, tiers), answered(1, 0, 1000, 0, tiers),
               answered(1, 1, 1100, 900, tiers), failed_record(1, 2, "timeout")]
    res = summarize(records, planned=6, rounds=3, duration_s=1.0)
    assert res.cached_tokens_reported is True
    assert res.hit_rate_after_round1 == pytest.approx((1000 + 1100 + 900) / (1100 + 1200 + 1100))
    assert res.cached_prompt_tokens == 64 + 1000 + 1100 + 900
    assert res.cached_tokens == {"device": 50, "host": 0, "storage": 0, "peer": 0}


def test_a_server_that_does_not_report_cached_tokens_gives_nulls_not_zeros() -> None:
    records = [answered(0, 0, 1000, None), answered(0, 1, 1100, None)]
    res = summarize(records, planned=2, rounds=2, duration_s=1.0)
    out = json.loads(json.dumps(res.to_json()))
    assert out["cached_tokens_reported"] is False
    assert out["cached_prompt_tokens"] is None and out["hit_rate_after_round1"] is None
    assert out["cached_tokens"] is None  # no `kvtier` field either: by tier unknown
    assert out["prompt_tokens"] == 2100


def test_one_answer_without_the_figure_makes_the_run_unreported() -> None:
    res = summarize([answered(0, 0, 100, 0), answered(0, 1, 120, None)], 2, 2, 1.0)
    assert (res.cached_tokens_reported, res.hit_rate_after_round1) == (False, None)


def test_hit_rate_is_null_without_a_later_round_or_prompt_tokens() -> None:
    assert summarize([answered(0, 0, 100, 0)], 1, 1, 1.0).hit_rate_after_round1 is None
    res = summarize([answered(0, 0, 0, 0), answered(0, 1, 0, 0)], 2, 2, 1.0)
    assert res.cached_tokens_reported and res.hit_rate_after_round1 is None
    assert summarize([failed_record(0, 0, "http_500")], 2, 2, 1.0).cached_tokens_reported is False


@pytest.mark.parametrize("usage, cached", [
    ({"prompt_tokens": 10}, None),  # vLLM without --enable-prompt-tokens-details
    ({"prompt_tokens": 10, "prompt_tokens_details": None}, None),
    ({"prompt_tokens": 10, "prompt_tokens_details": {}}, None),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": None}}, None),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}}, 0),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}, 8)])
def test_cached_tokens_are_read_from_the_standard_usage_field(usage: dict, cached) -> None:
    rec = answered_record(0, 1, StreamResult("hi", 0.1, 0.2, usage, {}))
    assert (rec.prompt_tokens, rec.cached_prompt_tokens, rec.cached_by_tier) == (10, cached, None)


def test_compare_keeps_each_runs_hit_rate_next_to_the_round2_ratio() -> None:
    on = summarize([answered(0, 0, 100, 0), answered(0, 1, 200, 100)], 2, 2, 1.0)
    off = summarize([answered(0, 0, 100, 0), answered(0, 1, 200, 0)], 2, 2, 1.0)
    out = compare(on, off)
    assert out["hit_rate_after_round1"] == 0.5 and out["off"]["hit_rate_after_round1"] == 0.0
    assert "round2_ttft_ratio" in out
