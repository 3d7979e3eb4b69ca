"""Serve settings, the admin rules and the text stream, without a server."""
from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import SchedulePolicy, StorageBackendKind
from kvtier.frontend.admin import check_admin_key, parse_admin_body
from kvtier.frontend.tenants import ApiKeys
from kvtier.frontend.openai_requests import ApiError
from kvtier.frontend.settings import L3_NONE, ModelChoice, ServeSettings
from kvtier.frontend.text_stream import TextStream


def test_settings_validate_and_round_trip():
    s = ServeSettings(model="tiny", instances=3, page_size=16, chunk_tokens=64)
    assert s.model is ModelChoice.TINY and len(s.admin_key) >= 16  # a random key by default
    assert ServeSettings.from_mapping(s.to_mapping()) == s
    assert s.max_prompt_tokens == 160 * 16 - 256 - 64
    # the cache off has no L3
    assert ServeSettings(enable_hierarchical_cache=False).storage_backend is None
    assert ServeSettings(storage_backend=L3_NONE).storage_backend is None
    with pytest.raises(ConfigError, match="did you mean 'instances'"):
        ServeSettings.from_mapping({"instancse": 2})
    with pytest.raises(ConfigError, match="multiple of page_size"):
        ServeSettings(page_size=64, chunk_tokens=96)
    with pytest.raises(ConfigError, match="storage_backend"):
        ServeSettings(storage_backend="floppy")
    with pytest.raises(ConfigError, match="at least 16"):
        ServeSettings(admin_key="short")
    with pytest.raises(ConfigError, match="raise device_pages"):
        ServeSettings(device_pages=4).max_prompt_tokens


def test_a_serve_config_takes_sglangs_names_and_the_earlier_keys():
    new = ServeSettings.from_mapping({"storage_backend": "nixl", "enable_hierarchical_cache": True})
    assert new.storage_backend is StorageBackendKind.NIXL and new.enable_hierarchical_cache
    old = ServeSettings.from_mapping({"l3": "nixl", "hierarchical": True})
    assert (old.storage_backend, old.enable_hierarchical_cache) == (StorageBackendKind.NIXL, True)
    assert ServeSettings.from_mapping({"l3": "none"}).storage_backend is None
    assert ServeSettings.from_mapping({"storage_backend": None}).storage_backend is None
    assert ServeSettings.from_mapping({"storage_backend": "none"}).storage_backend is None
    off = ServeSettings.from_mapping({"hierarchical": False})
    assert not off.enable_hierarchical_cache and off.storage_backend is None
    assert "l3" not in old.to_mapping() and "hierarchical" not in old.to_mapping()
    assert ServeSettings.from_mapping(old.to_mapping()) == old
    with pytest.raises(ConfigError, match="'l3' and 'storage_backend' are the same setting"):
        ServeSettings.from_mapping({"l3": "file", "storage_backend": "file"})
    with pytest.raises(ConfigError, match="'hierarchical' and 'enable_hierarchical_cache'"):
        ServeSettings.from_mapping({"hierarchical": True, "enable_hierarchical_cache": True})
    with pytest.raises(ConfigError, match="^l3: 'floppy'"):
        ServeSettings.from_mapping({"l3": "floppy"})


def test_engine_mode_and_schedule_policy_reach_every_rank():
    from kvtier.actors.serve_instance import rank_settings

    s = ServeSettings(model="tiny", page_size=16, chunk_tokens=64, schedule_policy="fcfs")
    assert ServeSettings.from_mapping(s.to_mapping()) == s
    r = rank_settings(s)
    assert (r.deterministic, r.schedule_policy, r.token_budget) == (False, SchedulePolicy.FCFS, 64)
    d = rank_settings(ServeSettings(model="tiny", page_size=16, deterministic=True))
    assert d.deterministic and d.schedule_policy is SchedulePolicy.LPM and d.token_budget >= 8192
    with pytest.raises(ConfigError, match="schedule_policy"):
        ServeSettings(schedule_policy="random")
    with pytest.raises(ConfigError, match="deterministic"):
        ServeSettings(deterministic="yes")
    import argparse

    from kvtier.cli.serve_command import add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cli = settings_from(parser.parse_args(["--deterministic", "--schedule-policy", "fcfs",
                                           "--dtype", "fp32"]))
    assert cli.deterministic and cli.schedule_policy is SchedulePolicy.FCFS
    assert cli.dtype.value == "fp32"
    plain = settings_from(parser.parse_args([]))
    assert not plain.deterministic and plain.schedule_policy is SchedulePolicy.LPM
    assert plain.dtype.value == "auto"  # resolved by each rank for its device


def test_admin_key_and_body():
    check_admin_key("Bearer key-0123456789abcdef", "key-0123456789abcdef")
    for header in ("", "Bearer nope", "key-0123456789abcdef", "Basic key-0123456789abcdef"):
        with pytest.raises(ApiError) as err:
            check_admin_key(header, "key-0123456789abcdef")
        assert err.value.status == 401
    assert ApiKeys().tenant("") == ""  # no API key: the OpenAI endpoints are open
    assert ApiKeys(api_key="sk-1").tenant("Bearer sk-1") == ""
    for header in ("", "Bearer sk-2", "sk-1", "Bearer admin-key-0123456789"):
        with pytest.raises(ApiError) as err:
            ApiKeys(api_key="sk-1").tenant(header)
        assert err.value.status == 401 and "api key" in err.value.message
    assert parse_admin_body(b"") == {}
    assert parse_admin_body(b'{"backend": "file"}') == {"backend": "file"}
    for raw, status in ((b"{x", 400), (b"[]", 400), (b'{"backend": 3}', 400),
                        (b'{"options": 1}', 400), (b" " * (65 << 10), 413)):
        with pytest.raises(ApiError) as err:
            parse_admin_body(raw)
        assert err.value.status == status


class ByteTokenizer:
    """Each token is one UTF-8 byte (a multi-byte character spans tokens, as in BPE)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_partial_characters_and_cuts_at_stops():
    data = list("héllo wörld. STOP and more".encode())
    stream = TextStream(ByteTokenizer(), stops=("STOP",))
    sent = ""
    for i in range(0, len(data), 1):
        text, stopped = stream.push(data[i:i + 1])
        assert "\ufffd" not in text
        sent += text
        if stopped:
            break
    sent += stream.finish()
    assert sent == "héllo wörld. " == stream.text
    plain = TextStream(ByteTokenizer())
    assert plain.push(data[:2])[0] == "h"  # the first byte of é waits
    assert plain.push(data[2:])[0] == "éllo wörld. STOP and more"[0:] and plain.finish() == ""


def test_text_stream_decodes_incrementally_with_the_real_tokenizer():
    import random

    from kvtier.engine.tokenizer import Tokenizer
    from kvtier.engine.weights import ensure_converted

    tok = Tokenizer.from_files(ensure_converted())
    calls = []

    class Counting:  # the real tokenizer, counting whole-output decodes
        def decode(self, ids):
            calls.append(len(ids))
            return tok.decode(ids)

        def decode_stream(self):
            return tok.decode_stream()

    rng = random.Random(1)
    samples = [tok.encode("Ünïcødé — 東京 🚀 and a STOP then more\n  def f(x): return x")]
    samples += [[rng.randrange(tok.vocab_size) for _ in range(30)] for _ in range(20)]
    for ids in samples:
        for stops in ((), ("STOP",)):
            calls.clear()
            stream, sent = TextStream(Counting(), stops), ""
            for t in ids:
                text, stopped = stream.push([t])
                sent += text
                if stopped:
                    break
            sent += stream.finish()
            assert sent == stream.text
            full = tok.decode(ids)
            assert (sent == full) if not stops or "STOP" not in full else \
                sent == full[:full.index("STOP")]
            assert len(calls) <= 1  # one whole decode at the end, none per token
