"""`kvtier bench storage`: kvtier's backend next to the raw library, same bytes, same run."""
from __future__ import annotations

import argparse
import importlib
import tempfile

from kvtier.bench import emit

_MEASURE = {
    "file": "kvtier.bench.storage_file",
    "mooncake": "kvtier.bench.storage_mooncake",
    "nixl": "kvtier.bench.storage_nixl",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=sorted(_MEASURE), default="file")
    p.add_argument("--pages", type=int, default=256, help="SmolLM2-sized pages (2 x 720 KiB each)")
    p.add_argument("--root-dir", default=None, help="where file/nixl objects go (default: a temp dir)")
    p.add_argument("--json", action="store_true")


def run(backend: str, pages: int, root_dir: str | None = None) -> dict:
    module = importlib.import_module(_MEASURE[backend])
    if backend == "mooncake":
        result = module.measure(pages)
    else:
        with tempfile.TemporaryDirectory(prefix=f"kvtier-bench-{backend}-",
                                         dir=root_dir) as tmp:
            result = module.measure(pages, tmp)
    return {"backend": backend, **result}


def main(ns: argparse.Namespace) -> int:
    result = run(ns.backend, ns.pages, ns.root_dir)
    emit(result, ns.json)
    return 0
