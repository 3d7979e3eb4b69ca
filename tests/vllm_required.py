"""For test modules that run vLLM: `require_vllm()` at the top of the module."""
from __future__ import annotations

import pytest


def require_vllm() -> None:
    """Import vLLM, or skip the module on a GPU host without it. `make test` installs vLLM's
    CPU build where there is no GPU, so there a missing vLLM is a broken install: it fails."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        import torch

        if not torch.cuda.is_available():
            raise
        pytest.skip("vLLM is not installed (on a GPU host, install it: docs/vllm.md)",
                    allow_module_level=True)
