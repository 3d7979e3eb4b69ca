"""Host-harness tests: network namespaces on a private bridge (root and `ip` needed; the
tests skip with the reason otherwise). Each module shares one network (and Ray cluster)."""
from __future__ import annotations

import pytest

from kvtier.hosts.network import why_unavailable

_WHY = why_unavailable()


def pytest_collection_modifyitems(config, items):
    if _WHY is None:
        return
    skip = pytest.mark.skip(reason=f"host harness unavailable: {_WHY}")
    for item in items:
        if "tests/hosts/" in str(item.fspath):
            item.add_marker(skip)
