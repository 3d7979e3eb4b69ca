"""Prefill/decode disaggregation's settings and flags: both counts or neither, no conflicting
--instances, a transport only with them; each error names the setting and its flag."""
from __future__ import annotations

import argparse

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import Transport
from kvtier.frontend.settings import ServeSettings
from kvtier.cli.serve_command import add_arguments, settings_from


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def settings(*argv: str) -> ServeSettings:
    return settings_from(parser().parse_args(list(argv)))


def test_the_flags_make_a_pd_graph_of_p_plus_d_instances():
    s = settings("--prefill-instances", "2", "--decode-instances", "3", "--tp", "2")
    assert (s.pd, s.prefill_instances, s.decode_instances, s.instances) == (True, 2, 3, 5)
    assert s.pd_transport is Transport.NIXL  # the default
    assert s.rank_cpus == 5  # 5 instances x TP 2 x 0.5 CPU
    mooncake = settings("--prefill-instances", "1", "--decode-instances", "1",
                        "--pd-transport", "mooncake")
    assert mooncake.pd_transport is Transport.MOONCAKE
    # --instances equal to P + D is no conflict
    assert settings("--instances", "2", "--prefill-instances", "1", "--decode-instances",
                    "1").instances == 2


def test_without_the_flags_nothing_changes():
    plain = settings()
    assert (plain.pd, plain.instances, plain.pd_transport) == (False, 2, None)
    assert settings("--instances", "3").instances == 3
    assert ServeSettings().instances == 2


def test_settings_cross_to_the_deployments_and_back():
    s = ServeSettings(model="tiny", prefill_instances=1, decode_instances=2,
                      pd_transport="mooncake")
    plain = s.to_mapping()
    assert (plain["prefill_instances"], plain["decode_instances"], plain["instances"],
            plain["pd_transport"]) == (1, 2, 3, "mooncake")
    assert ServeSettings.from_mapping(plain) == s
    assert ServeSettings.from_mapping(ServeSettings(model="tiny").to_mapping()).pd_transport \
        is None


@pytest.mark.parametrize("argv, names", [
    (["--prefill-instances", "1"], ["--prefill-instances", "--decode-instances"]),
    (["--decode-instances", "2"], ["--decode-instances", "--prefill-instances"]),
    (["--instances", "3", "--prefill-instances", "1", "--decode-instances", "1"],
     ["--instances", "drop --instances"]),
    (["--pd-transport", "mooncake"], ["--pd-transport", "--prefill-instances"]),
    (["--prefill-instances", "-1", "--decode-instances", "1"], ["--prefill-instances"]),
    (["--prefill-instances", "1", "--decode-instances", "65"], ["--decode-instances"]),
    (["--prefill-instances", "40", "--decode-instances", "40"], ["give fewer"]),
    (["--instances", "0"], ["--instances"]),
    (["--model", "gemma3-270m", "--prefill-instances", "1", "--decode-instances", "1"],
     ["--instances"]),
])
def test_bad_combinations_name_the_flag(argv, names):
    with pytest.raises(ConfigError) as err:
        settings(*argv)
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("values, name", [
    ({"prefill_instances": 1}, "decode_instances"),
    ({"prefill_instances": 1, "decode_instances": 1, "pd_transport": "ucx"}, "pd_transport"),
    ({"prefill_instances": "1", "decode_instances": 1}, "prefill_instances"),
    ({"prefill_instances": True, "decode_instances": 1}, "prefill_instances"),
    ({"pd_transport": "nixl"}, "pd_transport"),
])
def test_a_serve_config_gets_the_same_checks(values, name):
    with pytest.raises(ConfigError, match=name):
        ServeSettings.from_mapping({"model": "tiny", **values})


def test_an_unknown_transport_is_refused_by_the_flag_parser(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--prefill-instances", "1", "--decode-instances", "1",
                             "--pd-transport", "tcp"])
    assert "--pd-transport" in capsys.readouterr().err


def test_help_shows_the_flags():
    text = parser().format_help()
    for flag in ("--prefill-instances", "--decode-instances", "--pd-transport"):
        assert flag in text
    assert "nixl" in text and "mooncake" in text


def test_decode_instances_store_finished_conversations_in_l3_unless_told_not_to():
    on = settings("--prefill-instances", "1", "--decode-instances", "1")
    assert on.pd_decode_l3 is True  # the default
    off = settings("--prefill-instances", "1", "--decode-instances", "1", "--no-pd-decode-l3")
    assert off.pd_decode_l3 is False
    assert ServeSettings.from_mapping(off.to_mapping()).pd_decode_l3 is False
    with pytest.raises(ConfigError, match="pd_decode_l3.*--no-pd-decode-l3"):
        settings("--no-pd-decode-l3")  # only for a PD graph
    with pytest.raises(ConfigError, match="pd_decode_l3"):
        ServeSettings(prefill_instances=1, decode_instances=1, pd_decode_l3="no")


def test_peer_transport_crosses_and_refuses_what_it_cannot_serve():
    """Peer-to-peer L2 (--peer-transport): with or without L3, for kvtier's engine without
    a prefill/decode split and with L2 on; each refusal names the setting."""
    s = settings("--peer-transport", "mooncake", "--l3", "none")
    assert (s.peer_transport, s.storage_backend) == (Transport.MOONCAKE, None)
    assert ServeSettings.from_mapping(s.to_mapping()) == s
    assert settings().peer_transport is None
    for values in ({"prefill_instances": 1, "decode_instances": 1},
                   {"enable_hierarchical_cache": False}, {"peer_transport": "ucx"}):
        with pytest.raises(ConfigError, match="peer_transport"):
            ServeSettings.from_mapping({"model": "tiny", "peer_transport": "nixl", **values})
