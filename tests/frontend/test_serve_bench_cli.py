"""`kvtier bench serve`'s flags and sizing, and examples/serve_config.yaml against Ray Serve's
config schema. No servers start here."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.bench import serve_bench
from kvtier.cli.main import build_parser
from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind
from kvtier.frontend.settings import ServeSettings

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "serve_config.yaml"


def parse(*args: str):
    return build_parser().parse_args(["bench", "serve", *args])


def test_defaults() -> None:
    ns = parse()
    assert ns.func is serve_bench.main
    assert (ns.clients, ns.rounds, ns.rate, ns.turn_tokens, ns.max_tokens) == (4, 3, 0.0, 30, 16)
    assert ns.first_turn_tokens == 1000
    assert (ns.instances, ns.model, ns.port, ns.seed) == (1, "smollm2", 8100, 0)
    assert ns.device_pages is None and not ns.compare_off and not ns.json
    assert ns.chunk_tokens == ServeSettings().chunk_tokens  # kvtier serve's default


def test_flags() -> None:
    ns = parse("--clients", "6", "--rounds", "4", "--rate", "2.5", "--turn-tokens", "100",
               "--max-tokens", "8", "--instances", "2", "--model", "tiny", "--device-pages",
               "32", "--compare-off", "--port", "8123", "--seed", "7", "--chunk-tokens", "128",
               "--json")
    assert (ns.clients, ns.rounds, ns.rate, ns.turn_tokens, ns.max_tokens) == (6, 4, 2.5, 100, 8)
    assert (ns.instances, ns.model, ns.device_pages, ns.port, ns.seed) == (2, "tiny", 32, 8123, 7)
    assert ns.compare_off and ns.json and ns.chunk_tokens == 128
    assert serve_bench.serve_settings(ns, True).chunk_tokens == 128
    params = serve_bench.load_params(ns)
    assert (params.clients, params.rounds, params.turn_tokens, params.max_tokens) == (6, 4, 100, 8)
    assert params.request_rate == 2.5 and params.seed == 7 and not params.progress


def test_a_model_is_an_alias_or_a_directory(tmp_path) -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="no config.json"):  # not an alias: a directory
        serve_bench.serve_settings(parse("--model", "gpt4"), True)
    (tmp_path / "config.json").write_text("{}")
    s = serve_bench.serve_settings(parse("--model", str(tmp_path)), True)
    assert s.model.value == "path" and s.model_path == str(tmp_path)
    assert serve_bench.serve_settings(parse("--model", "tiny"), True).model.value == "tiny"


def test_on_and_off_settings_differ_only_in_the_cache() -> None:
    ns = parse("--device-pages", "24", "--instances", "2")
    on = serve_bench.serve_settings(ns, True, "/tmp/l3")
    off = serve_bench.serve_settings(ns, False)
    assert on.enable_hierarchical_cache and on.l3_root == "/tmp/l3"
    assert on.storage_backend is StorageBackendKind.FILE
    assert not off.enable_hierarchical_cache and off.storage_backend is None
    for name in ("model", "instances", "device_pages", "page_size", "chunk_tokens",
                 "max_new_tokens", "tp_size"):
        assert getattr(on, name) == getattr(off, name), name
    assert (on.device_pages, on.instances, on.max_new_tokens) == (24, 2, 16)


def test_default_l1_admits_the_last_round_but_not_every_history() -> None:
    ns = parse()
    s = serve_bench.serve_settings(ns, True)
    history = serve_bench.estimated_history_tokens(ns.rounds, ns.turn_tokens, ns.max_tokens,
                                                   ns.first_turn_tokens)
    assert history >= 1185  # measured with SmolLM2's tokenizer for the default shape
    assert s.max_prompt_tokens >= history  # the last round is admitted...
    per_conversation = serve_bench.conversation_pages(ns.rounds, ns.turn_tokens, ns.max_tokens,
                                                      first_turn_tokens=ns.first_turn_tokens)
    # ...but L1 holds one or two conversations, far from all four
    assert per_conversation < s.device_pages <= 2 * per_conversation
    defaults = ServeSettings()
    assert (s.chunk_tokens, s.page_size) == (defaults.chunk_tokens, defaults.page_size)
    assert s.device_pages < ns.clients * per_conversation
    # and the default follows the shape
    assert serve_bench.default_device_pages(3, 400, 16, first_turn_tokens=2000) > s.device_pages


def test_settings_report_has_no_admin_key() -> None:
    report = serve_bench.settings_report(parse("--compare-off"))
    assert "admin_key" not in report
    assert report["device_pages"] == serve_bench.device_pages_of(parse())
    assert report["hierarchical"] is True and report["compare_off"] is True
    assert report["l3"] == "file" and "storage_backend" not in report  # the report's keys
    assert report["all_histories_pages"] > report["device_pages"]


@pytest.mark.parametrize("args", [("--clients", "0"), ("--rate", "-1"),
                                  ("--device-pages", "4", "--chunk-tokens", "256"),
                                  ("--chunk-tokens", "100")])
def test_check_refuses_before_starting(args: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError):
        serve_bench.check(parse(*args))


# ---- examples/serve_config.yaml ------------------------------------------------------------
def load_config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_serve_config_matches_rays_schema() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = load_config()
    validate = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
    schema = validate(config)
    assert len(schema.applications) == 1
    app = schema.applications[0]
    assert app.import_path == "kvtier.actors.serve_graph:app_builder"
    assert app.route_prefix == "/"
    assert (schema.http_options.host, schema.http_options.port) == ("127.0.0.1", 8000)


def test_serve_config_args_are_serve_settings() -> None:
    args = load_config()["applications"][0]["args"]
    settings = ServeSettings.from_mapping(args)  # unknown keys or bad values raise
    assert settings.model.value == "smollm2" and settings.instances == 2
    assert settings.storage_backend is StorageBackendKind.FILE
    assert len(args["admin_key"]) >= 16
    assert "CHANGE THIS" in CONFIG.read_text()  # the placeholder says to replace it


def test_sglang_cache_flags_reach_the_app() -> None:
    ns = parse("--model", "tiny", "--hicache-write-policy", "write_back", "--hicache-ratio", "3",
               "--hicache-mem-layout", "page_first_direct")
    s = serve_bench.serve_settings(ns, True)
    assert s.hicache == {"write_policy": "write_back", "mem_layout": "page_head"}  # L3 on
    assert s.hicache_ratio == 3.0 and s.page_size == 64
    assert serve_bench.settings_report(ns)["hicache"] == s.hicache
    assert serve_bench.serve_settings(parse(), True).hicache == {}
    for flags, words in ((("--page-size", "32"), "--page-size"),
                         (("--hicache-storage-backend", "mooncake"), "storage-backend"),
                         (("--disable-hierarchical-cache",), "compare-off")):
        with pytest.raises(ConfigError, match=words):
            serve_bench.serve_settings(parse(*flags), True)
    with pytest.raises(ConfigError, match="SGLang's cache flags"):
        serve_bench.check(parse("--base-url", "http://127.0.0.1:9", "--hicache-write-policy",
                                "write_back"))
