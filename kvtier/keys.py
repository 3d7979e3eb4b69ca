"""Page keys: a SHA-256 chain over page-aligned token runs, seeded by the namespace.

`h_i = sha256(h_{i-1} || tokens of page i as little-endian uint32)`; with no seed the first
page has no prior digest, which gives the same chain as SGLang (tokens [1,2,3,4] ->
cf97adee...733b72). A namespace seed (model, tenant salt, layout fingerprint) makes the chain
of one namespace unreachable from another: two tenants never share a key. A cache salt (one
request's tenant inside a deployment) seeds a chain of its own inside the namespace.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from kvtier.errors import ConfigError, InvalidTokensError

UINT32_MAX = 2**32 - 1
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}")  # fullmatch: '$' allows a '\n'


def tokens_to_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as a little-endian uint32 array; raises on anything that is not one."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if hasattr(tokens, "tolist"):  # torch tensors
            tokens = tokens.tolist()
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidTokensError(f"token ids must be a flat sequence of ints: {exc}") from exc
    if arr.ndim != 1:
        raise InvalidTokensError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidTokensError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > UINT32_MAX):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise InvalidTokensError(f"token id {bad} is outside uint32 [0, {UINT32_MAX}]")
    return arr.astype("<u4", copy=False)


def page_hashes(
    tokens: Sequence[int], page_size: int, seed: bytes | None = None, prior: str | None = None,
    extras: Sequence[bytes] | None = None,
) -> list[str]:
    """Hex digests of every full page of `tokens` (a trailing partial page has no key).

    `seed` starts the chain of a namespace; `prior` continues a chain from an earlier digest;
    `extras[i]`, when given and not empty, is hashed after page i's tokens: what besides its
    tokens decides that page's KV (`PageInputs.extras`). A page without extras hashes as it
    always did.
    """
    if page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {page_size}")
    arr = tokens_to_array(tokens)
    raw = arr.tobytes()
    step = page_size * 4
    prev = bytes.fromhex(prior) if prior is not None else seed
    out: list[str] = []
    for i, start in enumerate(range(0, (len(arr) // page_size) * step, step)):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(raw[start : start + step])
        if extras is not None and i < len(extras) and extras[i]:
            h.update(extras[i])
        prev = h.digest()
        out.append(h.hexdigest())
    return out


class PlacedItem(NamedTuple):
    """A multimodal item of a prompt: its identifier (a digest of its content, as the engine
    computed it) and the placeholder tokens it fills."""

    identifier: str
    offset: int
    length: int


def _framed(tag: bytes, data: bytes) -> bytes:
    return tag + len(data).to_bytes(4, "little") + data


@dataclass(frozen=True)
class PageInputs:
    """What, besides its token ids, decides the KV of a request's pages, and so their keys
    (docs/architecture.md, "Page keys"): the tenant's cache salt and the LoRA adapter seed the
    request's chain; a multimodal item is keyed on every page its placeholder tokens touch
    (with its offset in the page: the same item elsewhere is other KV); prompt embeddings by
    a digest of each page's rows. Plain text under no adapter keys as the tokens alone did."""

    salt: str = ""
    adapter: str = ""  # the adapter's identity: its name and a digest of its weights
    items: tuple[PlacedItem, ...] = ()  # in placeholder order
    embeds: tuple[bytes, ...] = ()  # digest of page i's prompt embedding rows, from page 0

    @property
    def plain(self) -> bool:
        """Whether no page has extras (a page's key is its tokens under the chain seed)."""
        return not self.items and not self.embeds

    def extras(self, first: int, count: int, page_size: int) -> list[bytes] | None:
        """The extras of pages `first` .. `first + count - 1` (None: none has any)."""
        if self.plain:
            return None
        out = []
        for page in range(first, first + count):
            start, end = page * page_size, (page + 1) * page_size
            parts = [_framed(b"mm", item.identifier.encode() + (item.offset - start).to_bytes(
                         8, "little", signed=True))
                     for item in self.items
                     if item.offset < end and item.offset + item.length > start]
            if page < len(self.embeds):
                parts.append(_framed(b"pe", self.embeds[page]))
            out.append(b"".join(parts))
        return out


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: object) -> str:
    """A request's cache salt: any string of at most MAX_CACHE_SALT_CHARS characters ("" =
    unsalted). Raises ConfigError otherwise."""
    if not isinstance(salt, str):
        raise ConfigError(f"a cache salt must be a string, got {type(salt).__name__}")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ConfigError(f"a cache salt has at most {MAX_CACHE_SALT_CHARS} characters, got "
                          f"{len(salt)}")
    return salt


def _check_part(label: str, value: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"namespace {label} must be a string, got {type(value).__name__}")
    if allow_empty and value == "":
        return value
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise ConfigError(
            f"namespace {label} {value!r} is not allowed: use 1-128 characters from "
            "letters, digits, '.', '_', '-', '/', starting with a letter or digit, no '..'"
        )
    return value


def model_part(name: str) -> str:
    """`name` (a checkpoint's display name, which may hold spaces: 'Smollm2 135M ...', or a
    model directory's identity) as the model part of a namespace: each run of characters a
    part may not hold becomes '-', the ends lose '-', '.' and '/' ("model" if nothing is
    left). Every caller that names a model in a namespace goes through here."""
    return re.sub(r"[^A-Za-z0-9._/-]+", "-", name).strip("-./") or "model"


@dataclass(frozen=True)
class KeyNamespace:
    """Who may share pages: same model, same tenant salt, same byte layout."""

    model: str
    tenant_salt: str = ""
    layout_fingerprint: str = ""

    def __post_init__(self) -> None:
        _check_part("model", self.model)
        _check_part("tenant salt", self.tenant_salt, allow_empty=True)
        _check_part("layout fingerprint", self.layout_fingerprint, allow_empty=True)

    @property
    def seed(self) -> bytes:
        """The digest that starts every chain of this namespace."""
        h = hashlib.sha256(b"kvtier-namespace-v1")
        for part in (self.model, self.tenant_salt, self.layout_fingerprint):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little"))  # length-prefixed: no ambiguity
            h.update(data)
        return h.digest()

    def chain_seed(self, salt: str = "", adapter: str = "") -> bytes:
        """The digest that starts the chains of requests carrying `salt` and computed under
        LoRA adapter `adapter` ("" and "": the seed)."""
        seed = self.seed
        if salt:
            data = salt.encode()
            seed = hashlib.sha256(b"kvtier-salt-v1" + seed + len(data).to_bytes(4, "little")
                                  + data).digest()
        if adapter:
            seed = hashlib.sha256(_framed(b"kvtier-adapter-v1", seed)
                                  + _framed(b"", adapter.encode())).digest()
        return seed

    def request_keys(self, tokens: Sequence[int], page_size: int, inputs: PageInputs,
                     prior: str | None = None, first_page: int = 0) -> list[str]:
        """The keys of the full pages of `tokens`, pages `first_page` on of a request whose
        other inputs are `inputs`; `prior`: the key of page `first_page - 1` (None: the
        chain starts here, at page 0)."""
        seed = None if prior is not None else self.chain_seed(inputs.salt, inputs.adapter)
        pages = len(tokens) // page_size
        return page_hashes(tokens, page_size, seed=seed, prior=prior,
                           extras=inputs.extras(first_page, pages, page_size))

    @property
    def name(self) -> str:
        """A filesystem- and key-safe name: model with '/' as '-', plus a short seed digest."""
        return f"{self.model.replace('/', '-')}-{self.seed.hex()[:16]}"

    def page_hashes(self, tokens: Sequence[int], page_size: int, salt: str = "") -> list[str]:
        return page_hashes(tokens, page_size, seed=self.chain_seed(salt))


FORMAT_VERSION = 2  # 2: one object per KV head, named by head (1: per TP rank, by rank/size)
OBJECT_LAYOUT = "page_head"  # a stored object: one head's K or V of a page, (layer, token, dim)


@dataclass(frozen=True)
class PageCompute:
    """How pages were computed, where that decides their bits: part of the fingerprint.

    Deterministic mode promises answers bit-identical to a cold run (one-page prefill chunks,
    one sequence per forward), which only pages computed exactly as the reader's own cold run
    would give: in that mode, and by the same TP size (its all-reduces sum partial products in
    an order of their own) on the same kind of device (other kernels). By default pages
    differ in the last bits from run to run anyway (how many tokens ran together), so they are
    shared across TP sizes and devices, and never with deterministic ones, whose readers would
    read batched pages.
    """

    deterministic: bool = False
    tp_size: int = 1  # counts only in deterministic mode
    device: str = "cpu"  # a torch device type ("cpu", "cuda"); counts only in deterministic mode

    def __post_init__(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"PageCompute.deterministic must be a bool, got "
                              f"{self.deterministic!r}")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) \
                or self.tp_size < 1:
            raise ConfigError(f"PageCompute.tp_size must be a positive int, got {self.tp_size!r}")
        _check_part("device type", self.device)

    @property
    def fingerprint_part(self) -> str | None:
        """What the fingerprint adds (None by default: pages of any TP size and device)."""
        return f"deterministic/tp{self.tp_size}/{self.device}" if self.deterministic else None


BATCHED = PageCompute()  # the default mode


def layout_fingerprint(spec: object, total_kv_heads: int,
                       format_version: int = FORMAT_VERSION,
                       compute: PageCompute = BATCHED) -> str:
    """A short digest of everything that decides the bytes of a stored page.

    The reference names objects without the layout, so changing it reads bytes in the wrong
    order; kvtier puts this fingerprint in the namespace instead. It holds the model's total
    KV heads, never a rank's share, so instances of any TP size share pages; the object
    layout is always head-major (OBJECT_LAYOUT), whatever the host pool's layout; and how the
    pages were computed (`compute`: deterministic mode, with its TP size and device). The
    model's weights are the namespace's model part, not this.
    """
    parts = [
        f"v{format_version}",
        OBJECT_LAYOUT,
        str(getattr(spec, "dtype")),
        str(getattr(spec, "num_layers")),
        str(total_kv_heads),
        str(getattr(spec, "head_dim")),
        str(getattr(spec, "page_size")),
    ]
    sliding = getattr(spec, "sliding", None)
    if sliding is not None:  # a hybrid model's sliding layers: a pool of their own
        parts.append(f"sliding{sliding.num_layers}w{sliding.window}")
    if compute.fingerprint_part is not None:
        parts.append(compute.fingerprint_part)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
