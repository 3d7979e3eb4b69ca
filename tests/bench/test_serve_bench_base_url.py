"""`kvtier bench serve --base-url`: its flags, the defaults it shares with `kvtier serve`, and
the JSON it prints. No server starts here (tests/bench/test_serve_bench_remote.py runs one)."""
from __future__ import annotations

import json

import pytest

import kvtier.cli.main as cli
from kvtier.bench import serve_bench
from kvtier.bench.serve_load import LoadResult, RequestRecord, summarize
from kvtier.errors import ConfigError
from kvtier.frontend.settings import ServeSettings

URL = "http://10.0.0.7:8000"


def parse(*args: str):
    return cli.build_parser().parse_args(["bench", "serve", *args])


# ---- flags -------------------------------------------------------------------------------
def test_engine_and_cache_flags_default_to_kvtier_serves() -> None:
    ns = parse()
    serve_defaults = ServeSettings()
    settings = serve_bench.serve_settings(ns, True)
    for name in ("model", "page_size", "chunk_tokens", "hicache_ratio", "dtype", "tp_size"):
        assert getattr(settings, name) == getattr(serve_defaults, name), name
    serve_ns = cli.build_parser().parse_args(["serve"])
    assert (ns.model, ns.chunk_tokens) == (serve_ns.model, serve_ns.chunk_tokens)
    # the load's shape, L1 and instance count stay the bench's own
    assert settings.device_pages == serve_bench.device_pages_of(ns) != serve_defaults.device_pages
    assert settings.instances == 1 and settings.max_new_tokens == ns.max_tokens
    assert ns.base_url is None and ns.served_model_name is None and ns.app_flags == ()


@pytest.mark.parametrize("given, expected", [
    (URL, URL), (URL + "/", URL), (URL + "/v1", URL), (URL + "/v1/", URL),
    ("https://example.org/prefix/v1", "https://example.org/prefix")])
def test_base_url_is_taken_with_or_without_v1(given: str, expected: str) -> None:
    ns = parse("--base-url", given)
    serve_bench.check(ns)
    assert serve_bench.base_url_of(ns) == expected


@pytest.mark.parametrize("bad", ["", "10.0.0.7:8000", "ftp://host", "http://", "http://h?x=1"])
def test_a_base_url_that_is_no_http_address_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="--base-url"):
        serve_bench.check(parse("--base-url", bad))


@pytest.mark.parametrize("flags", [("--compare-off",), ("--instances", "1"),
                                   ("--model", "smollm2"), ("--device-pages", "64"),
                                   ("--chunk-tokens", "64"), ("--port", "8100"),
                                   ("--compare-off", "--port", "9000")])
def test_app_flags_are_refused_with_base_url_even_at_their_defaults(flags) -> None:
    ns = parse("--base-url", URL, *flags)
    with pytest.raises(ConfigError) as err:
        serve_bench.check(ns)
    for flag in flags:
        if flag.startswith("--"):
            assert flag in str(err.value)
    assert "kvtier's own app" in str(err.value)
    serve_bench.check(parse(*flags))  # fine without --base-url


def test_cli_answers_a_refused_flag_with_a_message_and_no_request(capsys) -> None:
    assert cli.main(["bench", "serve", "--base-url", URL, "--compare-off"]) == 2
    assert "--compare-off" in capsys.readouterr().err


def test_load_flags_and_the_model_name_go_to_the_load() -> None:
    ns = parse("--base-url", URL + "/v1", "--served-model-name", "llama", "--clients", "2",
               "--rounds", "5", "--rate", "1.5", "--turn-tokens", "9", "--first-turn-tokens",
               "50", "--max-tokens", "3", "--seed", "4", "--timeout", "30", "--json")
    serve_bench.check(ns)
    p = serve_bench.load_params(ns)
    assert (p.clients, p.rounds, p.request_rate, p.turn_tokens, p.first_turn_tokens) == (
        2, 5, 1.5, 9, 50)
    assert (p.max_tokens, p.seed, p.timeout_s, p.model, p.progress) == (3, 4, 30.0, "llama",
                                                                         False)
    report = serve_bench.settings_report(ns)
    assert report == {"base_url": URL, "served_model_name": "llama", "clients": 2, "rounds": 5,
                      "rate": 1.5, "turn_tokens": 9, "first_turn_tokens": 50, "max_tokens": 3,
                      "seed": 4}
    assert serve_bench.load_params(parse()).model is None  # the first model the server lists


def test_served_model_name_also_names_kvtiers_own_app() -> None:
    ns = parse("--served-model-name", "mine")
    assert serve_bench.serve_settings(ns, True).served_model_name == "mine"
    assert serve_bench.load_params(ns).model == "mine"
    assert serve_bench.settings_report(ns)["served_model_name"] == "mine"


def answered(round_: int, prompt: int) -> RequestRecord:
    """An answer from a server that does not report cached tokens."""
    return RequestRecord(0, round_, True, 0.1, 0.2, prompt, 4)


def test_main_with_base_url_prints_the_loads_json_and_starts_no_app(monkeypatch, capsys) -> None:
    sent = []

    def fake_load(url, params):
        sent.append((url, params))
        return summarize([answered(0, 100), answered(1, 150)], 2, 2, 1.0)

    def no_app(*_args):
        raise AssertionError("--base-url must not start kvtier's app")

    monkeypatch.setattr(serve_bench, "run_load_sync", fake_load)
    monkeypatch.setattr(serve_bench, "running_app", no_app)
    rc = cli.main(["bench", "serve", "--base-url", URL + "/v1", "--clients", "1", "--rounds",
                   "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [u for u, _ in sent] == [URL]
    assert out["benchmark"] == "serve" and out["settings"]["base_url"] == URL
    assert out["cached_tokens_reported"] is False and out["hit_rate_after_round1"] is None
    assert "off" not in out and "round2_ttft_ratio" not in out
    assert isinstance(LoadResult(**{k: v for k, v in out.items()
                                    if k not in ("benchmark", "settings")}), LoadResult)
