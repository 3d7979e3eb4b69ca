"""bench serve --check-cold: a served answer is compared with a cold deterministic replay."""
from __future__ import annotations

import torch

from kvtier.bench.serve_cold import answers_equal_cold
from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, SamplingParams
from kvtier.frontend.settings import ServeSettings

SETTINGS = ServeSettings(model="smollm2", dtype="fp32", page_size=16)
MESSAGES = ({"role": "user", "content": "Name a colour."},)


def test_an_answer_equal_to_the_cold_replay_counts_and_another_does_not() -> None:
    with Engine.smollm2(HiCacheConfig(page_size=16), device_pages=16,
                        dtype=torch.float32) as engine:
        prompt = engine.tokenizer.encode_chat(list(MESSAGES))
        (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
        stops = set(engine.tokenizer.stop_token_ids)
        served = engine.tokenizer.decode([t for t in out.tokens if t not in stops])
    result = answers_equal_cold([(MESSAGES, served), (MESSAGES, served + " not")], SETTINGS, 4)
    assert result == {"compared": 2, "equal": 1, "fraction": 0.5}
    assert answers_equal_cold([], SETTINGS, 4) is None
    assert answers_equal_cold([(MESSAGES, served)], ServeSettings(model="tiny"), 4) is None
