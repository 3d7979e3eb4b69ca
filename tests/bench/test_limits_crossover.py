"""Hardware limits, the crossover rule and the cached calibration (no SmolLM2 runs here)."""
from __future__ import annotations

import json
import logging

import pytest

import kvtier.config as config_mod
from kvtier.bench.crossover import Crossover, CrossoverPoint, crossover_from_points, find_crossover
from kvtier.bench.limits import Limits, filesystem_type, measure_limits
from kvtier.calibration import (CALIBRATION_ENV, Calibration, calibrated_thresholds,
                                calibration_path, load_calibration, round_up_to_page,
                                save_calibration)
from kvtier.config import HiCacheConfig
from kvtier.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh_log_memory():
    config_mod._reset_logged_for_tests()
    yield
    config_mod._reset_logged_for_tests()


@pytest.fixture
def cal_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    return path


# ---- limits ------------------------------------------------------------------------------

def test_limits_tiny_sizes_are_positive_and_json(tmp_path):
    limits = measure_limits(str(tmp_path), quick=True, size_scale=1 / 64)
    assert isinstance(limits, Limits)
    for name in ("memory_copy_gbps", "file_write_gbps", "file_read_gbps", "loopback_tcp_gbps"):
        value = getattr(limits, name)
        assert isinstance(value, float) and value > 0, (name, value)
    data = json.loads(json.dumps(limits.to_json()))
    assert set(data) == set(Limits._fields)
    assert isinstance(data["file_read_uncached"], bool)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_filesystem_type_of_root_is_known():
    assert filesystem_type("/") != ""


# ---- the crossover rule ------------------------------------------------------------------

def test_find_crossover_first_point_from_which_the_hit_always_wins():
    rows = [(64, 1.0, 1.2), (128, 1.0, 0.9), (256, 1.0, 1.1), (512, 2.0, 0.5), (1024, 4.0, 0.6)]
    assert find_crossover(rows) == 512  # 128 wins, but 256 loses again
    assert find_crossover(list(reversed(rows))) == 512  # order does not matter
    assert find_crossover([(64, 1.0, 0.5), (128, 1.0, 0.5)]) == 64
    assert find_crossover([(64, 1.0, 0.5), (128, 1.0, 1.0)]) is None  # a tie is no win
    assert find_crossover([(64, 1.0, 0.5), (128, 1.0, None)]) is None  # a missing hit
    assert find_crossover([]) is None


def test_crossover_from_points_per_tier_and_json():
    points = [CrossoverPoint(256, 1.0, 0.2, 0.9), CrossoverPoint(64, 0.3, 0.4, 0.5),
              CrossoverPoint(128, 0.5, 0.3, 0.6)]
    c = crossover_from_points(points, "fp32", skipped=[512])
    assert (c.host_tokens, c.storage_tokens) == (128, 256)
    assert [p.tokens for p in c.points] == [64, 128, 256]
    data = json.loads(json.dumps(c.to_json()))
    assert data["host_tokens"] == 128 and data["dtype"] == "fp32" and data["skipped"] == [512]
    assert data["points"][0] == {"tokens": 64, "cold_s": 0.3, "host_s": 0.4, "storage_s": 0.5}


# ---- calibration -------------------------------------------------------------------------

def _crossover(host, storage, dtype="bf16"):
    return Crossover(host, storage, (CrossoverPoint(64, 0.3, 0.1, 0.2),), dtype)


def test_path_from_env_and_default(cal_file, monkeypatch):
    assert calibration_path() == cal_file
    monkeypatch.delenv(CALIBRATION_ENV)
    assert str(calibration_path()).endswith(".cache/kvtier/calibration.json")


def test_save_load_round_trip_per_machine_model_dtype(cal_file):
    assert load_calibration() is None
    saved = save_calibration(_crossover(64, 128))
    assert cal_file.exists()
    loaded = load_calibration()
    assert loaded == saved and (loaded.host_tokens, loaded.storage_tokens) == (64, 128)
    assert loaded.details["points"][0]["tokens"] == 64 and loaded.measured_at
    save_calibration(_crossover(128, None, dtype="fp32"))
    save_calibration(_crossover(192, 320))  # replaces the bf16 entry
    assert load_calibration().host_tokens == 192
    assert load_calibration("fp32").storage_tokens is None
    assert load_calibration(machine="elsewhere") is None
    assert len(json.loads(cal_file.read_text())["calibrations"]) == 2


def test_thresholds_applied_to_defaults_rounded_up_to_a_page(cal_file):
    save_calibration(_crossover(70, 300))
    c = calibrated_thresholds(HiCacheConfig(page_size=64))
    assert (c.load_back_threshold_tokens, c.prefetch_threshold_tokens) == (128, 320)
    assert sum("calibrated" in a for a in c.adjustments) == 2
    again = calibrated_thresholds(c)
    assert again.adjustments == c.adjustments  # nothing left to change
    c16 = calibrated_thresholds(HiCacheConfig(page_size=16))
    assert (c16.load_back_threshold_tokens, c16.prefetch_threshold_tokens) == (80, 304)


def test_explicit_fields_are_left_alone(cal_file):
    save_calibration(_crossover(70, 300))
    # From a dict (as the flags and --hicache-config build it): set even to the default value.
    c = calibrated_thresholds(HiCacheConfig.from_dict({"load_back_threshold_tokens": 10}))
    assert (c.load_back_threshold_tokens, c.prefetch_threshold_tokens) == (10, 320)
    assert HiCacheConfig.from_dict({"page_size": 32}).explicit == frozenset({"page_size"})
    # Built in Python: a non-default value counts as set.
    c = calibrated_thresholds(HiCacheConfig(prefetch_threshold_tokens=512))
    assert (c.load_back_threshold_tokens, c.prefetch_threshold_tokens) == (128, 512)
    c = calibrated_thresholds(HiCacheConfig(explicit={"prefetch_threshold_tokens"}))
    assert c.prefetch_threshold_tokens == 256 and c.load_back_threshold_tokens == 128


def test_explicit_survives_normalize_and_is_not_a_knob():
    c = HiCacheConfig.from_dict({"load_back_threshold_tokens": 10, "page_size": 512}).normalize()
    assert c.is_explicit("load_back_threshold_tokens") and not c.is_explicit("hicache_ratio")
    assert "explicit" not in c.to_dict() and c == HiCacheConfig(page_size=512).normalize()
    with pytest.raises(ConfigError, match="explicit"):
        HiCacheConfig.from_dict({"explicit": []})
    with pytest.raises(ConfigError, match="nonsense"):
        HiCacheConfig(explicit={"nonsense"})


def test_never_won_keeps_the_default(cal_file, caplog):
    caplog.set_level(logging.INFO)
    save_calibration(_crossover(None, 128))
    c = calibrated_thresholds(HiCacheConfig())
    assert (c.load_back_threshold_tokens, c.prefetch_threshold_tokens) == (10, 128)
    assert "never beat recomputing" in caplog.text


def test_no_calibration_leaves_the_config_and_says_how(cal_file, caplog):
    caplog.set_level(logging.INFO)
    config = HiCacheConfig()
    assert calibrated_thresholds(config) is config
    assert "kvtier bench matrix" in caplog.text


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 99, "calibrations": []}',
                                  '{"version": 1, "calibrations": [{"machine": "x"}]}',
                                  '{"version": 1}'])
def test_corrupt_file_is_ignored_with_a_warning(cal_file, caplog, text):
    cal_file.parent.mkdir(parents=True)
    cal_file.write_text(text)
    with caplog.at_level(logging.WARNING, logger="kvtier.calibration"):
        assert load_calibration() is None
        assert calibrated_thresholds(HiCacheConfig()) == HiCacheConfig()
    assert "ignoring the calibration file" in caplog.text
    save_calibration(_crossover(64, 64))  # a new calibration replaces the bad file
    assert load_calibration().host_tokens == 64


def test_bad_token_counts_are_rejected():
    base = Calibration("m", "x", "bf16", 64, 64).to_json()
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError):
            Calibration.from_json({**base, "host_tokens": bad})


def test_round_up_to_page():
    assert [round_up_to_page(t, 64) for t in (0, 1, 64, 65, 128)] == [64, 64, 64, 128, 128]


def test_cli_flags_count_as_explicit(cal_file):
    import argparse

    from kvtier.cli.flags import add_hicache_flags, config_from_args
    parser = argparse.ArgumentParser()
    add_hicache_flags(parser)
    save_calibration(_crossover(70, 300))
    config = config_from_args(parser.parse_args(["--hicache-load-back-threshold", "10"]))
    c = calibrated_thresholds(config)
    assert (c.load_back_threshold_tokens, c.prefetch_threshold_tokens) == (10, 320)
