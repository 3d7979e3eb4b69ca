"""The layout rule and the layering, read from every package module's imports (with `ast`).

Layers, bottom to top: the vocabulary of `kvtier/` <- backends <- tiers <- engine <- serve <-
actors and vLLM engines as instances (`vllm_engine/`) <- bench, hosts, the commands of `cli/`
and vLLM's connector. A module may import from its own layer or below; only `actors/` may
import ray, and only `connector/`, `vllm_engine/` and `bench/` vllm. Tests and
examples are outside these rules.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# folder -> layer
LAYERS = {"kvtier": 0, "backends": 1, "tiers": 2, "engine": 3, "frontend": 4, "actors": 5,
          "vllm_engine": 5, "bench": 6, "hosts": 6, "cli": 6, "connector": 6}
# `kvtier/__main__.py` only hands `python -m kvtier` to the command line
ENTRY_POINT = "kvtier.__main__"
TOP = 6
RAY_ALLOWED = {"actors"}
VLLM_ALLOWED = {"connector", "vllm_engine", "bench"}  # the connector, the engines the graph
# serves with, and `kvtier bench vllm`


def module_layer(dotted: str) -> int | None:
    """The layer of module `kvtier.X...` (None: not one of ours)."""
    parts = dotted.split(".")
    if parts[0] != "kvtier":
        return None
    if len(parts) == 1:
        return 0
    if parts[1] in LAYERS and parts[1] != "kvtier":
        return LAYERS[parts[1]]
    return TOP if dotted == ENTRY_POINT else 0


def package_modules() -> list[tuple[pathlib.Path, str]]:
    """(file, dotted name) of every module the package installs."""
    out = []
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [] if folder == "kvtier" else [folder]
            parts += [p for p in rel.parts if p != "__init__"]
            out.append((path, ".".join(["kvtier", *parts])))
    return out


def imported(tree: ast.AST, dotted: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import in the module, lazy ones inside functions included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = dotted.split(".")
                pkg = pkg if is_package else pkg[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # `from kvtier import demo` imports the module kvtier.demo
            found += [(node.lineno, f"{base}.{alias.name}" if base == "kvtier" else base)
                      for alias in node.names]
    return found


def module_violations(tree: ast.AST, dotted: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, what is wrong) for each import of one module that breaks the rules."""
    layer, folder = module_layer(dotted), (dotted.split(".") + ["kvtier"])[1]
    folder = folder if folder in LAYERS else "kvtier"
    bad = []
    for line, target in imported(tree, dotted, is_package):
        if target.split(".")[0] == "ray" and folder not in RAY_ALLOWED:
            bad.append((line, f"imports {target}: only actors/ may import ray"))
            continue
        if target.split(".")[0] == "vllm" and folder not in VLLM_ALLOWED:
            bad.append((line, f"imports {target}: only connector/, vllm_engine/ and bench/ may import vllm"))
            continue
        target_layer = module_layer(target)
        if target_layer is not None and target_layer > layer:
            bad.append((line, f"imports {target} (layer {target_layer}) from layer {layer}: "
                              "an upward import"))
    return bad


def violations() -> list[str]:
    out = []
    for path, dotted in package_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        out += [f"{path.relative_to(ROOT)}:{line} {what}"
                for line, what in module_violations(tree, dotted, path.name == "__init__.py")]
    return out


def test_every_module_imports_only_its_layer_or_below():
    assert violations() == []


def test_no_python_module_left_inside_kvtier_subfolders():
    """`kvtier.X` lives in `X/`: kvtier/ itself has no subpackages."""
    nested = [str(p.relative_to(ROOT)) for p in (ROOT / "kvtier").rglob("*.py")
              if p.parent != ROOT / "kvtier"]
    assert nested == []


def test_every_folder_is_installed_under_its_name():
    """pyproject maps each `kvtier.X` to the folder `X/`, and nothing else; its packages are
    those and each subpackage inside them (`X/Y/__init__.py`: `kvtier.X.Y`)."""
    import tomllib
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    expected = {"kvtier" if f == "kvtier" else f"kvtier.{f}": f for f in LAYERS}
    assert tool["package-dir"] == expected
    subpackages = [".".join(["kvtier", f, *init.parent.relative_to(ROOT / f).parts])
                   for f in LAYERS if f != "kvtier"
                   for init in (ROOT / f).rglob("__init__.py") if init.parent != ROOT / f]
    assert sorted(tool["packages"]) == sorted([*expected, *subpackages])


@pytest.mark.parametrize("source, dotted, message", [
    ("from kvtier.actors.instance import Instance", "kvtier.engine.scheduler", "upward"),
    ("import ray", "kvtier.tiers.radix_tree", "only actors/"),
    ("from ray.util import collective", "kvtier.frontend.metrics", "only actors/"),
    ("from kvtier.cli import demo", "kvtier.config", "upward"),
    ("from kvtier.cli.flags import add_hicache_flags", "kvtier.actors.instance", "upward"),
    ("from ..engine import scheduler", "kvtier.tiers.radix_tree", "upward"),
    ("from kvtier.bench import soak", "kvtier.actors.instance", "upward"),
    ("from vllm.config import VllmConfig", "kvtier.engine.hf_export", "only connector/"),
])
def test_the_checker_catches_what_it_must(source, dotted, message):
    """The rules applied to snippets (lazy imports inside a function too)."""
    tree = ast.parse(f"def f():\n    {source}\n")
    problems = module_violations(tree, dotted, False)
    assert len(problems) == 1 and message in problems[0][1]


@pytest.mark.parametrize("source, dotted", [
    ("import ray", "kvtier.actors.instance"),
    ("from kvtier.actors.instance import Instance", "kvtier.cli.demo"),
    ("from kvtier.cli.demo import namespace_spec", "kvtier.bench.pd"),
    ("from kvtier.cli.main import main", "kvtier.__main__"),
    ("from kvtier.tiers.radix_tree import HiRadixTree", "kvtier.engine.admission"),
    ("from kvtier.frontend import metrics", "kvtier.actors.serve_ingress"),
    ("from vllm import LLM", "kvtier.connector.vllm_connector"),
])
def test_the_checker_allows_what_it_must(source, dotted):
    assert module_violations(ast.parse(source), dotted, False) == []
