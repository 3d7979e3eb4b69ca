"""The serve tests' shared cluster (shared_serve.py) stops when the tests leave this directory."""
from __future__ import annotations

from pathlib import Path

import pytest
import shared_serve

HERE = Path(__file__).parent


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # the modules' fixtures delete their apps first
    finally:
        if nextitem is None or not Path(nextitem.path).is_relative_to(HERE):
            shared_serve.stop()
