"""`kvtier demo` (and `bench instances`, `bench soak`) flags: --model ALIAS|DIR and SGLang's
--hicache-* flags listed with the demo's defaults, a model directory and cache knobs reaching
the ranks' cache config and the L3 namespace the demo registers (checked against a TP=1 rank
built in-process, no Ray), flags the demo cannot honour refused by name, --tp checked against
the model's KV heads."""
from __future__ import annotations

import pytest

import kvtier.cli.main as cli

from kvtier.cli import demo, demo_flags
from kvtier.actors.rank_actor import CacheDescription, Rank
from kvtier.bench import instances
from kvtier.bench.prefix import document_tokens
from kvtier.config import HiCacheConfig
from kvtier.engine.hf_dir import HFModelDir
from kvtier.errors import ConfigError
from kvtier.messages import unpack_record
from kvtier.policies import IoBackend, MemLayout, PrefetchPolicy, WritePolicy

pytest.importorskip("transformers")
from tiny_llama import make_checkpoint  # noqa: E402 - tests/tiny_llama.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, expected", [
    (["demo"], ["--model smollm2|gemma3-270m|tiny|DIR|FILE.gguf",
                "smollm2 (SmolLM2-135M-Instruct)", "(default smollm2;",
                "--tp TP", "(default 3;", "--l3 {file,mooncake,nixl}", "(default file,",
                "--page-size TOKENS", "(default 64)", "--hicache-ratio RATIO", "(default 2)",
                "--hicache-write-policy", "default write_through", "--hicache-io-backend",
                "default kernel", "--hicache-mem-layout", "default page_first",
                "--hicache-storage-prefetch-policy", "default wait_complete",
                "--hicache-storage-backend", "what --l3 says (default file)",
                "--hicache-storage-backend-extra-config", "only root_dir",
                "--disable-hierarchical-cache refused", "--hicache-config @FILE"]),
    (["bench", "instances"], ["--model smollm2|gemma3-270m|tiny|DIR", "(default 3;",
                              "--l3 {file,mooncake,nixl,none}", "--peer",
                              "--page-size TOKENS", "default wait_complete",
                              "--hicache-mem-layout", "--hicache-config @FILE"]),
    (["bench", "soak"], ["--model smollm2|gemma3-270m|tiny|DIR", "default smollm2"]),
    (["bench", "prefix"], ["--model smollm2|gemma3-270m|DIR|FILE.gguf", "--dtype {auto,bf16,fp32}"]),
    (["bench", "transfer"], ["--dtype {bf16,fp16,fp32}", "KV page dtype (default bf16)"]),
    (["bench", "chaos"], ["--l3 {file,mooncake,none}", "--dtype {auto,bf16,fp32}", "(default fp32:",
                          "(default tiny:"]),
    (["serve"], ["--l3 file|mooncake|nixl|simulated|none", "--dtype {auto,bf16,fp32}",
                 "(default 1)", "(default smollm2;"]),
])
def test_help_lists_the_flags_with_defaults(argv, expected, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert [e for e in expected if e not in text] == []


def test_no_flags_are_the_demo_as_before() -> None:
    assert demo.params_from(parse("demo")) == demo.DemoParams()
    assert instances.params_from(parse("bench", "instances")) == demo.DemoParams()
    config = demo_flags.cache_config("file", 64)
    assert config == HiCacheConfig(page_size=64,
                                   prefetch_policy="wait_complete").normalize_for_l3("file")
    assert config.mem_layout is MemLayout.PAGE_HEAD  # the layout L3's objects need
    assert config.storage_backend is None  # the namespace attaches L3


def test_a_model_directory_and_cache_flags_reach_the_ranks(model_dir, tmp_path) -> None:
    argv = ["--model", str(model_dir), "--tp", "1", "--dtype", "fp32",
            "--hicache-mem-layout", "page_first_direct", "--hicache-write-policy", "write_back"]
    params = demo.params_from(parse("demo", *argv))
    assert instances.params_from(parse("bench", "instances", *argv)) == params._replace(
        progress=True)
    assert params.model == str(model_dir)
    assert dict(params.hicache) == {"mem_layout": "page_first_direct",
                                    "write_policy": "write_back"}
    model = demo.demo_model(params.model)
    work = demo._workload(params._replace(tokens=512), model)
    config = work.settings.config
    assert work.settings.source == HFModelDir(str(model_dir))
    assert (config.mem_layout, config.write_policy) == (MemLayout.PAGE_HEAD,  # L3 on
                                                        WritePolicy.WRITE_BACK)
    assert config.io_backend is IoBackend.KERNEL
    assert config.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE  # the demo's own default
    tok = HFModelDir(str(model_dir)).tokenizer()
    assert work.prompts[0][:512] == document_tokens(tok, 512)  # the directory's tokenizer
    spec = demo._namespace_spec(params, work, str(tmp_path / "l3"))
    rank = Rank(0, 1, "", work.settings)  # what each of the instances' ranks builds
    try:
        desc = unpack_record(CacheDescription, rank.describe())
        assert rank.engine.cache.config == config
    finally:
        rank.close()
    assert (spec.model, spec.layout_fingerprint) == (desc.model, desc.layout_fingerprint)
    assert spec.model == HFModelDir(str(model_dir)).identity()  # name and weights digest


@pytest.mark.parametrize("argv, match", [
    (["--disable-hierarchical-cache"], "--disable-hierarchical-cache: kvtier demo"),
    (["--hicache-host-mode", "storage_only", "--hicache-storage-backend", "file"],
     "--hicache-host-mode storage_only: kvtier demo"),
    (["--l3", "nixl", "--hicache-storage-backend", "file"], "--l3 nixl and "
                                                            "--hicache-storage-backend file"),
    (["--hicache-storage-backend", "simulated"], "kvtier demo's L3 is one of"),
    (["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
      '{"protocol": "rdma"}'], "takes only root_dir there.*remove protocol"),
    (["--l3-root", "/a", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", '{"root_dir": "/b"}'], "--l3-root and"),
    (["--page-size", "1024"], "--page-size 1024: the demo prefills in 512-token chunks"),
])
def test_what_the_demo_cannot_honour_is_refused_by_name(argv, match) -> None:
    with pytest.raises(ConfigError, match=match):
        demo._check_params(demo.params_from(parse("demo", *argv)))


def test_the_extra_configs_root_dir_is_the_l3_root() -> None:
    params = demo.params_from(parse("demo", "--hicache-storage-backend", "nixl",
                                    "--hicache-storage-backend-extra-config",
                                    '{"root_dir": "/data/kv"}'))
    assert (params.l3, params.l3_root, params.hicache) == ("nixl", "/data/kv", ())


def test_tp_must_divide_the_models_kv_heads(model_dir) -> None:
    with pytest.raises(ConfigError, match=r"KV heads of tiny-llama \(2\): use 1 or 2; got 3"):
        demo.run(demo.DemoParams(model=str(model_dir), tp_size=3, progress=False))
