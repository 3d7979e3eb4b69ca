"""Hugging Face model directories: tiny random Llama and Qwen2 checkpoints made here with
transformers match transformers' logits; the chat template renders as transformers renders
it; what kvtier does not run is refused by name; the digest tells checkpoints apart."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from cache_builder import build_cache

from kvtier.engine.batch import SeqChunk
from kvtier.engine.hf_dir import HFModelDir
from kvtier.engine.model import PagedLlama
from kvtier.engine.weights import ensure_converted
from kvtier.errors import ConfigError
from kvtier.tiers.device_pool import DevicePool

transformers = pytest.importorskip("transformers")

VOCAB = 49152  # SmolLM2's tokenizer.json is the tokenizer of these checkpoints
TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_dir(tmp_path, arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    model.eval()
    path = tmp_path / f"{arch}-{seed}"
    model.save_pretrained(path)
    shutil.copy(ensure_converted() / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path, model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tiny_checkpoint_matches_transformers(tmp_path, arch):
    path, reference = make_dir(tmp_path, arch)
    source = HFModelDir(str(path))
    cfg = source.config()
    assert cfg.attention_bias == (arch == "qwen2") and not cfg.tie_word_embeddings
    model = PagedLlama.from_state_dict(cfg, source.state_dict(), torch.float32, "cpu")
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with DevicePool(model.kv_spec(16), 8, "cpu") as pool:
        ours = model(tokens, [SeqChunk(list(range(3)), 0, 40)], pool, all_logits=True)
        # and the same positions again, as a hit: the first 32 from the pool, 8 computed
        hit = model(tokens[32:], [SeqChunk(list(range(3)), 32, 8)], pool, all_logits=True)
    with torch.no_grad():
        theirs = reference(tokens[None]).logits[0].float()
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
    assert torch.allclose(hit, theirs[32:], atol=1e-4, rtol=1e-4)


def test_the_chat_template_renders_as_transformers_does(tmp_path):
    path, _ = make_dir(tmp_path, "llama")
    ours = HFModelDir(str(path)).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    for messages in ([{"role": "user", "content": "Hi  "}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "A"}, {"role": "user", "content": "Ü?"}]):
        for gen in (True, False):
            assert ours.apply_chat_template(messages, gen) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    assert ours.encode_chat([{"role": "user", "content": "Hi"}])[0] == \
        ours.token_to_id("<|im_start|>")
    assert ours.stop_token_ids == (ours.token_to_id("<|im_end|>"),)
    with pytest.raises(ConfigError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # wins
    assert HFModelDir(str(path)).tokenizer().apply_chat_template(
        [{"role": "user", "content": "x"}]) == "x!"


def test_what_kvtier_does_not_run_is_refused_by_name(tmp_path):
    path, _ = make_dir(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())

    def refused(match, **changes):
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ConfigError, match=match):
            HFModelDir(str(path)).config()

    refused("sliding-window", architectures=["MistralForCausalLM"], sliding_window=4096)
    refused("'GPT2LMHeadModel' is not supported", architectures=["GPT2LMHeadModel"])
    refused("RoPE scaling", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    refused("hidden_act", hidden_act="gelu")
    refused("mlp_bias", mlp_bias=True)
    (path / "config.json").write_text(json.dumps(config))
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        HFModelDir(str(path)).state_dict()
    with pytest.raises(ConfigError, match="no config.json"):
        HFModelDir(str(tmp_path / "nowhere")).config()


def test_the_digest_tells_checkpoints_apart(tmp_path):
    a, _ = make_dir(tmp_path, "llama", seed=0)
    b, _ = make_dir(tmp_path, "llama", seed=1)
    same = tmp_path / "copy"
    shutil.copytree(a, same)
    assert HFModelDir(str(a)).digest() == HFModelDir(str(same)).digest()
    assert HFModelDir(str(a)).digest() != HFModelDir(str(b)).digest()
    assert HFModelDir(str(a)).config() == HFModelDir(str(b)).config().__class__(
        **{**HFModelDir(str(b)).config().to_dict(), "name": "llama-0"})  # same shapes
    source = HFModelDir(str(a))
    digest = source.digest()
    with source.weight_files()[0].open("ab") as fh:  # the checkpoint changes under it
        fh.write(b"\0")
    # one object reads its files once (`identity` reuses the digest); a rank builds its own
    # object from the path, so it sees the change and refuses the weights
    assert source.identity().endswith(digest[:16]) and source.digest() == digest
    assert HFModelDir(str(a)).digest() != digest


def test_two_checkpoints_of_one_architecture_share_no_l3_page(tmp_path):
    from kvtier.config import HiCacheConfig
    from kvtier.engine import Engine, SamplingParams
    
    dirs = [HFModelDir(str(make_dir(tmp_path, "llama", seed=s)[0])) for s in (0, 1)]
    config = HiCacheConfig(page_size=16, storage_backend="file",
                           storage_options={"root_dir": str(tmp_path / "l3")},
                           prefetch_policy="wait_complete", prefetch_threshold_tokens=16)
    prompt = list(range(100, 164))  # 4 pages

    def run(source: HFModelDir):
        model = PagedLlama.from_state_dict(source.config(), source.state_dict(), torch.float32,
                                           "cpu")
        cache = build_cache(model.kv_spec(16), 16, config, model=source.identity())
        with Engine(model, cache, owns_cache=True) as engine:
            (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=1))
            engine.cache.flush()
            engine.cache.storage.drain()
        return out

    assert run(dirs[0]).cached.storage == 0
    assert run(dirs[1]).cached.storage == 0  # same shapes, other weights: other keys
    assert run(dirs[0]).cached.storage == 48  # its own pages are there (3 of 4: the last
    # page holds the token whose logits are computed)
