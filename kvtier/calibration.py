"""Load thresholds calibrated on this machine: measured once, cached, overridable.

The two thresholds that decide whether a cache hit is worth loading,
`load_back_threshold_tokens` (L2 -> L1) and `prefetch_threshold_tokens` (L3 -> L2), have
fixed defaults (10 and 256 tokens, the reference's). Where loading actually starts to beat
recomputing depends on the machine, the model and the dtype, so:

- **Calibrated once**: `kvtier bench matrix` runs `kvtier.bench.crossover.measure_crossover`
  and stores the result with `save_calibration`.
- **Cached**: in a JSON file, one entry per (machine, model, dtype); the default file is
  `~/.cache/kvtier/calibration.json`, the env var `KVTIER_CALIBRATION` names another.
  Re-running the calibration replaces the entry; deleting the file forgets it. An unreadable
  or malformed file is ignored with a warning (the fixed defaults apply).
- **Overridable**: `calibrated_thresholds(config)` sets a threshold only where the user did
  not (see `HiCacheConfig.is_explicit`): the `host` crossover becomes the load-back
  threshold and the `storage` crossover the prefetch threshold, each rounded up to a whole
  page. A flag or config-file value always wins. A tier whose loading never beat
  recomputing in the measured range keeps its default (logged). Without a calibration the
  config comes back unchanged, with a log line saying how to calibrate.

A config built directly in Python (not from flags or a dict) does not know which knobs were
set; a value equal to the field's default then counts as not set.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.config import HiCacheConfig, log_once

log = logging.getLogger(__name__)

CALIBRATION_ENV = "KVTIER_CALIBRATION"
DEFAULT_PATH = "~/.cache/kvtier/calibration.json"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
FORMAT_VERSION = 1
THRESHOLDS = {"load_back_threshold_tokens": "host_tokens",
              "prefetch_threshold_tokens": "storage_tokens"}  # config field <- crossover tier


class Calibration(NamedTuple):
    """The crossovers (tokens; None: loading never won in the measured range) of one
    machine, model and dtype."""

    machine: str
    model: str
    dtype: str
    host_tokens: int | None
    storage_tokens: int | None
    measured_at: str = ""  # ISO 8601, UTC
    details: dict | None = None  # the measurement's JSON (points, rule, ...), for people

    def key(self) -> tuple[str, str, str]:
        return (self.machine, self.model, self.dtype)

    def to_json(self) -> dict:
        return self._asdict()

    @classmethod
    def from_json(cls, d: Any) -> "Calibration":
        """From `to_json()` data; ValueError if it is not that shape."""
        if not isinstance(d, dict) or not {"machine", "model", "dtype"} <= d.keys():
            raise ValueError(f"not a calibration entry: {d!r:.200}")
        cal = cls(**{k: d.get(k, cls._field_defaults.get(k)) for k in cls._fields})
        for name in ("host_tokens", "storage_tokens"):
            value = getattr(cal, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a token count or null, got {value!r}")
        return cal


def calibration_path() -> Path:
    """The cache file: $KVTIER_CALIBRATION, else ~/.cache/kvtier/calibration.json."""
    return Path(os.path.expanduser(os.environ.get(CALIBRATION_ENV) or DEFAULT_PATH))


def machine_id() -> str:
    """This machine for calibration purposes: host name, accelerator (or CPU) and cores."""
    import torch  # lazily: reading a config should not pay for importing torch

    if torch.cuda.is_available():
        device = f"cuda:{torch.cuda.get_device_name(0)}"
    else:
        device = f"cpu:{_cpu_model()}x{os.cpu_count()}"
    return f"{platform.node()}/{device}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_calibration(dtype: str = "bf16", model: str = DEFAULT_MODEL,
                     machine: str | None = None) -> Calibration | None:
    """The cached calibration of this machine (or `machine`), `model` and `dtype`, or None."""
    key = (machine or machine_id(), model, dtype)
    return next((c for c in _read_all(calibration_path()) if c.key() == key), None)


def save_calibration(crossover: Any, dtype: str | None = None, model: str = DEFAULT_MODEL,
                     machine: str | None = None) -> Calibration:
    """Cache a measured crossover (a `kvtier.bench.crossover.Crossover`, or anything with
    `host_tokens`, `storage_tokens` and optionally `dtype` and `to_json()`), replacing the
    entry of the same machine, model and dtype. Written atomically; returns the entry."""
    dtype = dtype or getattr(crossover, "dtype", None) or "bf16"
    details = crossover.to_json() if hasattr(crossover, "to_json") else None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cal = Calibration(machine or machine_id(), model, dtype, crossover.host_tokens,
                      crossover.storage_tokens, now, details)
    Calibration.from_json(cal.to_json())  # the same checks a later load makes
    path = calibration_path()
    kept = [c for c in _read_all(path) if c.key() != cal.key()]
    data = {"version": FORMAT_VERSION, "calibrations": [c.to_json() for c in kept + [cal]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    log.info("calibration saved to %s: %s", path, _describe(cal))
    return cal


def _read_all(path: Path) -> list[Calibration]:
    """Every entry of the cache file; [] (with a warning) if it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"expected {{'version': {FORMAT_VERSION}, 'calibrations': [...]}}")
        return [Calibration.from_json(d) for d in data["calibrations"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the calibration file %s (%s); the fixed thresholds apply. "
                    "Delete it or run `kvtier bench matrix` to calibrate again", path, exc)
        return []


def calibrated_thresholds(config: HiCacheConfig, dtype: str = "bf16",
                          model: str = DEFAULT_MODEL,
                          calibration: Calibration | None = None) -> HiCacheConfig:
    """`config` with the load thresholds the user did not set taken from the calibration
    (`calibration`, else the cached one), rounded up to a page; unchanged without one."""
    cal = calibration or load_calibration(dtype, model)
    if cal is None:
        log_once(f"no load-threshold calibration for {model} ({dtype}) on this machine in "
                 f"{calibration_path()}: using the fixed thresholds; run `kvtier bench matrix` "
                 f"to calibrate")
        return config
    changes: dict[str, int] = {}
    notes: list[str] = []
    for name, tier in THRESHOLDS.items():
        tokens, current = getattr(cal, tier), getattr(config, name)
        if config.is_explicit(name):
            continue
        if tokens is None:
            log_once(f"calibration: loading from {tier.removesuffix('_tokens')} never beat "
                     f"recomputing in the measured range; {name} stays {current}")
            continue
        value = round_up_to_page(tokens, config.page_size)
        if value != current:
            changes[name] = value
            notes.append(f"{name} {current} -> {value}: calibrated {tier.removesuffix('_tokens')} "
                         f"crossover {tokens} tokens ({cal.measured_at or 'undated'})")
    for note in notes:
        log_once(f"hicache config adjusted: {note}")
    if not changes:
        return config
    return dataclasses.replace(config, **changes, adjustments=config.adjustments + tuple(notes))


def round_up_to_page(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages, at least one page."""
    return max(1, -(-tokens // page_size)) * page_size


def _describe(cal: Calibration) -> str:
    return (f"{cal.model} {cal.dtype} on {cal.machine}: load back from {cal.host_tokens}, "
            f"prefetch from {cal.storage_tokens} tokens")
