import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError, InvalidTokensError
from kvtier.keys import FORMAT_VERSION, KeyNamespace, PageCompute, layout_fingerprint, page_hashes
from kvtier.kv_spec import KVSpec

VECTOR = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"


def test_reference_vector():
    assert page_hashes([1, 2, 3, 4], 4) == [VECTOR]
    assert page_hashes(np.array([1, 2, 3, 4]), 4) == [VECTOR]
    assert page_hashes(torch.tensor([1, 2, 3, 4]), 4) == [VECTOR]


def test_chain_and_partial_page():
    two = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(two) == 2 and two[0] == VECTOR
    assert page_hashes([5, 6, 7, 8], 4, prior=VECTOR) == [two[1]]
    assert page_hashes([5, 6, 7, 8], 4) != [two[1]]  # position in the chain matters


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**32, 1, 2, 3], [1.5, 2, 3, 4], [[1, 2]], ["a"]])
def test_tokens_outside_uint32_raise(bad):
    with pytest.raises(InvalidTokensError):
        page_hashes(bad, 1)


def test_boundary_tokens_are_fine():
    assert len(page_hashes([0, 2**32 - 1], 1)) == 2


def test_the_fingerprint_holds_total_heads_and_format_never_a_ranks_share():
    rank_of_3 = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4)
    whole = KVSpec(num_layers=2, num_kv_heads=3, head_dim=4, page_size=4)
    assert layout_fingerprint(rank_of_3, 3) == layout_fingerprint(whole, 3)  # any TP size
    assert layout_fingerprint(whole, 3) != layout_fingerprint(whole, 6)  # another model
    assert FORMAT_VERSION == 2
    assert layout_fingerprint(whole, 3, format_version=1) != layout_fingerprint(whole, 3)


def test_namespaces_separate_tenants_models_and_layouts():
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4)
    fp1 = layout_fingerprint(spec, 1)
    fp2 = layout_fingerprint(KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4), 1)
    assert fp1 != fp2
    a = KeyNamespace("smollm2", "tenant-a", fp1)
    b = KeyNamespace("smollm2", "tenant-b", fp1)
    c = KeyNamespace("smollm2", "tenant-a", fp2)
    hashes = {ns.page_hashes([1, 2, 3, 4], 4)[0] for ns in (a, b, c)}
    assert len(hashes) == 3 and VECTOR not in hashes
    assert a.page_hashes([1, 2, 3, 4], 4) == KeyNamespace("smollm2", "tenant-a", fp1).page_hashes([1, 2, 3, 4], 4)


@pytest.mark.parametrize("model", ["", "../etc", "a/../b", "x y", "a\x00b", "-lead", "m" * 200])
def test_namespace_parts_cannot_escape(model):
    with pytest.raises(ConfigError):
        KeyNamespace(model)


def test_namespace_name_is_path_safe():
    ns = KeyNamespace("HuggingFaceTB/SmolLM2-135M-Instruct", "t1")
    assert "/" not in ns.name and ns.name.startswith("HuggingFaceTB-SmolLM2")


def test_the_fingerprint_keys_deterministic_pages_apart_by_tp_size_and_device():
    """Deterministic pages are bit-exact only where they were computed the same way: their
    own fingerprint, per TP size and device; default pages are shared across both."""
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=4, page_size=4)
    batched = {layout_fingerprint(spec, 3, compute=PageCompute(False, tp, device))
               for tp in (1, 3) for device in ("cpu", "cuda")}
    assert batched == {layout_fingerprint(spec, 3)}  # the default mode, as before
    det = {layout_fingerprint(spec, 3, compute=PageCompute(True, tp, device))
           for tp in (1, 3) for device in ("cpu", "cuda")}
    assert len(det) == 4 and not det & batched
    with pytest.raises(ConfigError, match="tp_size"):
        PageCompute(True, 0)


def test_a_model_name_becomes_a_valid_model_part():
    from kvtier.keys import model_part

    assert model_part("Smollm2 135M Instruct") == "Smollm2-135M-Instruct"
    assert model_part("org/name") == "org/name" and model_part("/.-x y-./") == "x-y"
    assert model_part("  ") == "model" and model_part("***") == "model"
    for name in ("Smollm2 135M Instruct", "a b/c d", "x\ny"):
        KeyNamespace(model_part(name))  # accepted
