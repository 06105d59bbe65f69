"""Content-addressed store of compiled artifacts (local folder + optional S3), used by compile and serve.

Typical use::

    inputs = CacheKeyInputs(architecture=architecture_config(cfg), target="cpu", compiler="torch-aotinductor",
                            compiler_version=torch.__version__, n_positions=2048, context_buckets=(128, 512),
                            token_buckets=(256, 2048), dtype="bf16", batch_size=8)
    entry = CompileCache(remote="s3://bucket/prefix").get_or_compile(inputs, lambda out: compile_into(out))
    load_from(entry.path)

See ``key.py`` (what a key hashes), ``store.py`` (layout, atomicity, locking), ``s3.py`` (remote layout),
``layers.py`` (a read-only store, such as SageMaker's ``/opt/ml/model``, in front of a writable one).
"""

from compile_cache.errors import (
    CacheError,
    CacheMissError,
    CorruptEntryError,
    EntryNotFoundError,
    RemoteError,
)
from compile_cache.key import (
    ARTIFACT_FORMAT_VERSION,
    GQA_STRATEGIES,
    KEY_LENGTH,
    TARGETS,
    CacheKeyInputs,
    architecture_config,
    fingerprint_weights,
    halved_context_buckets,
    normalize_dtype,
    token_generation_buckets,
)
from compile_cache.layers import is_writable_dir, open_store, writable_cache_root
from compile_cache.lock import LockTimeoutError
from compile_cache.manifest import Manifest, ManifestError, VerifyReport
from compile_cache.store import CompileCache, Entry, PruneReport, default_cache_root

__all__ = [
    "ARTIFACT_FORMAT_VERSION",
    "GQA_STRATEGIES",
    "KEY_LENGTH",
    "TARGETS",
    "CacheError",
    "CacheKeyInputs",
    "CacheMissError",
    "CompileCache",
    "CorruptEntryError",
    "Entry",
    "EntryNotFoundError",
    "LockTimeoutError",
    "Manifest",
    "ManifestError",
    "PruneReport",
    "RemoteError",
    "VerifyReport",
    "architecture_config",
    "default_cache_root",
    "fingerprint_weights",
    "halved_context_buckets",
    "is_writable_dir",
    "normalize_dtype",
    "open_store",
    "token_generation_buckets",
    "writable_cache_root",
]
