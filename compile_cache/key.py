"""Cache keys: a canonical description of everything that changes a compiled artifact, and its hash.

The description (``CacheKeyInputs.describe()``) is a flat JSON object whose fields are listed in
``CacheKeyInputs``; the key is the first ``KEY_LENGTH`` (24) hex characters of the SHA-256 of that
object serialised as canonical JSON (``sort_keys=True``, no whitespace, ASCII only). 24 hex chars are
96 bits: a collision among even a billion entries has probability below 1e-11.

Invariants:
* every field of ``CacheKeyInputs`` is in the description, so changing any field changes the key;
* nothing else is: dict ordering, list-vs-tuple, dtype aliases (``bf16``/``bfloat16``) and GQA spelling
  (``shard_over_heads``/``shard-over-heads``) are normalised before hashing;
* ``ARTIFACT_FORMAT_VERSION`` is part of the description: bump it whenever this project changes how it
  writes artifacts, and every old entry stops matching instead of being misread.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ARTIFACT_FORMAT_VERSION = 1
KEY_LENGTH = 24
TARGETS = ("cpu", "neuron")
GQA_STRATEGIES = ("shard-over-heads", "shard-over-batch", "replicated-heads", "all-gather-heads")
_DTYPE_ALIASES = {
    "fp32": "fp32", "f32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}  # fmt: skip
# Keys of a Hugging Face config.json that name where or by what it was saved, not what it computes.
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def canonical_json(obj: Any) -> str:
    """The one serialisation hashed into keys: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def normalize_dtype(dtype: str) -> str:
    """Map ``float16``/``f16``/``fp16``/… to LMI's names ``fp32``, ``fp16``, ``bf16``."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"dtype: unknown {dtype!r}; expected one of fp32, fp16, bf16 (or their aliases)")
    return _DTYPE_ALIASES[name]


def architecture_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A model ``config.json`` minus keys that do not change a compiled graph (``VOLATILE_CONFIG_KEYS``)."""
    return {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}


def _int_tuple(name: str, values: Iterable[Any]) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: every bucket must be a positive int, got {v!r}")
        out.append(v)
    if out != sorted(set(out)):
        raise ValueError(f"{name}: buckets must be strictly increasing, got {out}")
    return tuple(out)


@dataclass(frozen=True, eq=True)
class CacheKeyInputs:
    """Everything that changes a compiled artifact. Frozen; validated and normalised on construction.

    ``architecture`` is the model's architecture config (pass ``architecture_config(config_json)``); it is
    stored as a canonical-JSON round trip so that later mutation of the caller's dict cannot change it.
    ``weights_fingerprint`` is set only when the artifact embeds the weights (see ``fingerprint_weights``).
    ``library_args`` is every argument handed to the compiling library that the fields above do not
    already name (a ``NeuronConfig``'s keyword arguments, ``from_pretrained`` keywords, the application
    class): a stale hit must never differ from what would be compiled now. Absent (None) it is left
    out of the description, so keys written before the field existed keep matching.
    ``isa_features`` names the instruction-set features the build host let the artifact use
    (``avx512_bf16``, ``amx_tile``, ...: CPU artifacts are built with ``-march=native``). A host
    lacking any computes another key and compiles its own (``missing_isa_features`` says what it
    lacks). None (Neuron artifacts, which run on NeuronCores) leaves it out of the description.
    """

    architecture: Mapping[str, Any]
    target: str
    compiler: str
    compiler_version: str
    n_positions: int
    context_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    dtype: str
    batch_size: int = 1
    tensor_parallel_degree: int = 1
    gqa_strategy: str | None = None
    compiler_flags: tuple[str, ...] = ()
    weights_fingerprint: str | None = None
    library_args: Mapping[str, Any] | None = None
    isa_features: tuple[str, ...] | None = None
    format_version: int = field(default=ARTIFACT_FORMAT_VERSION)

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, Mapping):
            raise ValueError(f"architecture: expected a dict, got {type(self.architecture).__name__}")
        try:
            arch = json.loads(canonical_json(dict(self.architecture)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"architecture: not JSON-serialisable ({exc})") from exc
        object.__setattr__(self, "architecture", arch)
        if self.library_args is not None:
            if not isinstance(self.library_args, Mapping):
                raise ValueError(f"library_args: expected a dict, got {type(self.library_args).__name__}")
            try:
                args = json.loads(canonical_json(dict(self.library_args)))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"library_args: not JSON-serialisable ({exc})") from exc
            object.__setattr__(self, "library_args", args)
        if self.target not in TARGETS:
            raise ValueError(f"target: expected one of {TARGETS}, got {self.target!r}")
        for name in ("compiler", "compiler_version"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"{name}: must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("n_positions", "batch_size", "tensor_parallel_degree", "format_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        object.__setattr__(self, "context_buckets", _int_tuple("context_buckets", self.context_buckets))
        object.__setattr__(self, "token_buckets", _int_tuple("token_buckets", self.token_buckets))
        for name in ("context_buckets", "token_buckets"):
            buckets = getattr(self, name)
            if not buckets or buckets[-1] > self.n_positions:
                raise ValueError(
                    f"{name}: must be non-empty and <= n_positions={self.n_positions}, got {buckets}"
                )
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.gqa_strategy is not None:
            gqa = str(self.gqa_strategy).strip().lower().replace("_", "-")
            if gqa not in GQA_STRATEGIES:
                raise ValueError(
                    f"gqa_strategy: expected one of {GQA_STRATEGIES} or None, got {self.gqa_strategy!r}"
                )
            object.__setattr__(self, "gqa_strategy", gqa)
        if isinstance(self.compiler_flags, str):
            raise ValueError("compiler_flags: pass a sequence of flags, not one string")
        object.__setattr__(self, "compiler_flags", tuple(str(f) for f in self.compiler_flags))
        if self.isa_features is not None:
            if isinstance(self.isa_features, str):
                raise ValueError("isa_features: pass a sequence of feature names, not one string")
            names = {str(f).strip().lower() for f in self.isa_features}
            if "" in names:
                raise ValueError(f"isa_features: empty feature name in {self.isa_features!r}")
            object.__setattr__(self, "isa_features", tuple(sorted(names)))
        if self.weights_fingerprint is not None and not str(self.weights_fingerprint).strip():
            raise ValueError("weights_fingerprint: must be None or a non-empty string")

    def __hash__(self) -> int:
        return hash(self.key())

    def describe(self) -> dict[str, Any]:
        """The canonical description hashed into the key: every field, JSON types only."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("library_args", "isa_features") and value is None:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def key(self) -> str:
        """``sha256(canonical_json(describe()))[:KEY_LENGTH]`` as lowercase hex."""
        digest = hashlib.sha256(canonical_json(self.describe()).encode("ascii")).hexdigest()
        return digest[:KEY_LENGTH]

    @property
    def namespace(self) -> str:
        """The store folder grouping entries: ``<target>-<compiler version>`` (filesystem-safe)."""
        safe = "".join(c if c.isalnum() or c in "._+-" else "_" for c in self.compiler_version)
        return f"{self.target}-{safe}"

    @classmethod
    def from_description(cls, description: Mapping[str, Any]) -> CacheKeyInputs:
        """Rebuild from ``describe()`` output (e.g. a manifest); unknown/missing fields raise ValueError."""
        names = {f.name for f in fields(cls)}
        unknown = set(description) - names
        if unknown:
            raise ValueError(f"key inputs: unknown fields {sorted(unknown)}")
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in description.items()})
        except TypeError as exc:
            raise ValueError(f"key inputs: {exc}") from exc


def missing_isa_features(inputs: CacheKeyInputs, available: Iterable[str]) -> tuple[str, ...]:
    """The features an artifact's build host let it use (``inputs.isa_features``) that a host with
    ``available`` lacks, sorted: empty where it may run there (and for artifacts that name none)."""
    return tuple(sorted(set(inputs.isa_features or ()) - set(available)))


def token_generation_buckets(n_positions: int, start: int = 128) -> tuple[int, ...]:
    """transformers-neuronx's convention: token-generation buckets double from 128 up to ``n_positions``."""
    if n_positions <= 0:
        raise ValueError(f"n_positions: must be positive, got {n_positions}")
    buckets, size = [], start
    while size < n_positions:
        buckets.append(size)
        size *= 2
    buckets.append(n_positions)
    return tuple(buckets)


def halved_context_buckets(
    token_buckets: Sequence[int], estimate: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The CPU bucket graphs' context policy (``neuron_lmi.backends.cpu.aot``, and ``neuron-lmi cache key``'s
    default): explicit ``context_length_estimate`` if given, else half of each token bucket, as
    transformers-neuronx's own default is. The Neuron backends have theirs, named for their library
    (``tnx_context_buckets``, ``nxdi_context_buckets``)."""
    if estimate:
        return tuple(sorted(set(int(x) for x in estimate)))
    return tuple(sorted({max(1, b // 2) for b in token_buckets}))


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short to be safetensors")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 * 1024 * 1024:
            raise ValueError(f"{path}: implausible safetensors header length {length}")
        header = fh.read(length)
        if len(header) != length:
            raise ValueError(f"{path}: truncated safetensors header")
    return header


def _file_digest(path: Path) -> str:
    # A Hugging Face hub cache stores files as blobs named by their sha256: reuse it instead of reading GBs.
    target = path.resolve()
    name = target.name
    if target.parent.name == "blobs" and len(name) == 64 and all(c in "0123456789abcdef" for c in name):
        return name
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def fingerprint_weights(path: str | os.PathLike[str], mode: str = "content") -> str:
    """A fingerprint of a checkpoint's weight files (a file, or every weight file under a folder).

    ``mode="content"`` (default) hashes each file's SHA-256 (free for Hugging Face hub blobs, whose names
    are their SHA-256), so any changed value changes the fingerprint. ``mode="headers"`` hashes only
    file names, sizes and safetensors headers (names, dtypes, shapes, offsets): milliseconds, but blind
    to changed values with unchanged shapes, so use it only when the artifact does not embed values.
    Returns ``"<mode>:<sha256 hex>"``.
    """
    if mode not in ("content", "headers"):
        raise ValueError(f"mode: expected 'content' or 'headers', got {mode!r}")
    root = Path(path)
    if root.is_file():
        files = [(root.name, root)]
    elif root.is_dir():
        files = sorted(
            (p.relative_to(root).as_posix(), p)
            for p in root.rglob("*")
            if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
        )
    else:
        raise FileNotFoundError(f"weights: {root} does not exist")
    if not files:
        raise FileNotFoundError(f"weights: no {', '.join(WEIGHT_SUFFIXES)} files under {root}")
    h = hashlib.sha256()
    for rel, p in files:
        size = p.stat().st_size
        if mode == "content":
            part = _file_digest(p)
        elif p.name.endswith(".safetensors"):
            part = hashlib.sha256(_safetensors_header(p)).hexdigest()
        else:
            part = ""
        h.update(canonical_json([rel, size, part]).encode("ascii"))
    return f"{mode}:{h.hexdigest()}"
