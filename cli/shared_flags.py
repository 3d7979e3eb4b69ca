"""The flags several commands take, each declared once: `--model`, `--dtype`, `--tp`, `--l3`,
`--l3-root`, `--pd-transport` and `--schedule-policy` (SGLang's `--hicache-*` flags are
cli.flags'). Each builder adds one flag to a parser or an argument group, with its one list of
choices taken from the vocabulary (DType, StorageBackendKind, SchedulePolicy, Transport, the
serve settings' ModelChoice); a command that handles fewer of them names its own subset, and
says why there.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.dtypes import DType
from kvtier.policies import SchedulePolicy, StorageBackendKind, Transport
from kvtier.frontend.settings import L3_NONE, ModelChoice


class Adds(Protocol):
    """An argparse parser or argument group."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


# Gemma-3 270M's alias as users type it (engine.gemma3_package.ALIAS, without importing torch;
# ModelChoice.parse takes either spelling)
GEMMA3_ALIAS = ModelChoice.GEMMA3_270M.value.replace("_", "-")
# The model aliases `--model` takes (the spelling users type), and what each one is
MODEL_ALIASES: dict[str, str] = {
    ModelChoice.SMOLLM2.value: "SmolLM2-135M-Instruct",
    GEMMA3_ALIAS: "Gemma-3 270M, TP 1",  # ModelChoice.GEMMA3_270M
    ModelChoice.TINY.value: "random weights over SmolLM2's vocabulary: fast, for tests",
}
# The in-process benchmarks (bench prefix, bench matrix) build their model with
# kvtier.bench.prefix.loader, which has no random-weight model: no `tiny` there.
LOADED_MODEL_ALIASES = (ModelChoice.SMOLLM2.value, GEMMA3_ALIAS)
DTYPES = tuple(d.value for d in DType)
# The L3 backends an L3 namespace actor serves across processes (simulated is in-process)
SHARED_L3 = (StorageBackendKind.FILE, StorageBackendKind.MOONCAKE, StorageBackendKind.NIXL)


def add_model_flag(p: Adds, default: str = ModelChoice.SMOLLM2.value,
                   aliases: Sequence[str] = tuple(MODEL_ALIASES), note: str = "",
                   **kwargs: Any) -> None:
    """`--model ALIAS|DIR|FILE.gguf`. `aliases`: the subset of MODEL_ALIASES the command
    runs; `note` ends the help; `kwargs` go to add_argument (an action, say)."""
    unknown = sorted(set(aliases) - set(MODEL_ALIASES))
    if unknown:
        raise ValueError(f"add_model_flag: unknown aliases {unknown}; use MODEL_ALIASES' keys")
    named = ", ".join(f"{a} ({MODEL_ALIASES[a]})" for a in aliases)
    p.add_argument("--model", default=default, metavar="|".join(aliases) + "|DIR|FILE.gguf",
                   help=f"{named}, a Hugging Face model directory (Llama, Mistral without a "
                        f"sliding window or Qwen2; safetensors weights, tokenizer.json) or a "
                        f"Llama or Gemma-3 GGUF file (default {default}{note})", **kwargs)


def add_dtype_flag(p: Adds, default: str = DType.AUTO.value, note: str = "",
                   choices: Sequence[str] = DTYPES, subject: str = "model and KV dtype",
                   **kwargs: Any) -> None:
    """`--dtype {auto,bf16,fp32}`, the model and KV dtype (DType). `note` ends the help;
    `choices` and `subject`: another set, for a command that measures bare KV pages (no
    model to resolve `auto` for); `kwargs` go to add_argument."""
    auto = ("; auto: bf16 on GPUs and CPUs that compute in bf16, fp32 on other CPUs, where "
            "bf16 is about 4x slower") if DType.AUTO.value in choices else ""
    p.add_argument("--dtype", choices=tuple(choices), default=default,
                   help=f"{subject} (default {default}{note}{auto})", **kwargs)


def add_tp_flag(p: Adds, default: int | None, note: str = "") -> None:
    """`--tp N`, TP ranks per instance. `note` ends the help (what the default means)."""
    shown = "" if default is None and note else f"default {default}"
    p.add_argument("--tp", type=int, default=default,
                   help=f"TP ranks per instance, a divisor of the model's KV heads "
                        f"({shown}{'; ' if shown and note else ''}{note})")


def add_l3_flag(p: Adds, default: str | None, kinds: Sequence[StorageBackendKind] = SHARED_L3,
                allow_none: bool = False, note: str = "") -> None:
    """`--l3 KIND`, the L3 backend. `kinds`: the StorageBackendKinds the command runs;
    `allow_none`: `none` (no L3) is one more choice. A command that takes every kind leaves
    the check to its settings (so a flag and a config file fail alike): no argparse choices."""
    names = [k.value for k in kinds] + ([L3_NONE] if allow_none else [])
    every = set(kinds) == set(StorageBackendKind) and allow_none
    # default None: not given, and the command settles it with SGLang's
    # --hicache-storage-backend (cli.flags.l3_from_flags): file when neither is given
    shown = default or StorageBackendKind.FILE.value
    p.add_argument("--l3", default=default, choices=None if every else names,
                   metavar="|".join(names) if every else None,
                   help=f"L3 backend: {', '.join(names)} (default {shown}{note})")


def add_l3_root_flag(p: Adds, note: str = "") -> None:
    """`--l3-root DIR`, the file/nixl L3 directory ("" when not given)."""
    p.add_argument("--l3-root", default="",
                   help=f"file/nixl L3 directory (default: a temp dir{note})")


def add_pd_transport_flag(p: Adds, default: str | None, note: str = "") -> None:
    """`--pd-transport {nixl,mooncake}`: how prefill ranks write KV into decode ranks' pages
    (Transport). `default` None: the command picks (nixl) when it runs a prefill/decode
    graph; `note` ends the help."""
    p.add_argument("--pd-transport", default=default,
                   choices=tuple(t.value for t in Transport.across_processes()),
                   help=f"how prefill ranks write KV into decode ranks' pages (default "
                        f"{default or Transport.NIXL.value}{note})")


def add_schedule_policy_flag(p: Adds, default: str = SchedulePolicy.LPM.value, note: str = "",
                             **kwargs: Any) -> None:
    """`--schedule-policy {lpm,fcfs}`, the admission order (SchedulePolicy); `kwargs` go to
    add_argument."""
    p.add_argument("--schedule-policy", choices=tuple(m.value for m in SchedulePolicy),
                   default=default,
                   help=f"admission order: lpm (longest cached prefix first, with aging) or "
                        f"fcfs (arrival order) (default {default}{note})", **kwargs)
