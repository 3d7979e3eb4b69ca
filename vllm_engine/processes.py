"""The processes of the vLLM engines a process started: each engine's EngineCore and its TP
workers (vLLM names them `VLLM::EngineCore` and `VLLM::Worker...`), found by walking the
process tree under this process in /proc (Linux), for fault drills that signal them
(`kvtier bench chaos --engine vllm`).
"""
from __future__ import annotations

import os
from typing import NamedTuple

ENGINE_CORE = "VLLM::EngineCore"
WORKER = "VLLM::Worker"


class EngineProcesses(NamedTuple):
    """The pids of one process's vLLM engines: their EngineCores and their workers (with
    TP 1 too, vLLM's CPU build runs the model in a worker process of its own)."""

    cores: tuple[int, ...]
    workers: tuple[int, ...]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def engine_processes(root: int | None = None) -> EngineProcesses:
    """The vLLM engine processes below `root` (default: this process), at any depth."""
    cores: list[int] = []
    workers: list[int] = []
    todo, seen = [os.getpid() if root is None else root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        title = _title(pid)
        if title.startswith(ENGINE_CORE):
            cores.append(pid)
        elif title.startswith(WORKER):
            workers.append(pid)
        todo += _children(pid)
    return EngineProcesses(tuple(sorted(cores)), tuple(sorted(workers)))
