"""The local store: miss then hit, atomic entries, damage detection and recovery, listing, pruning."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from compile_cache.errors import CacheError, CacheMissError, CorruptEntryError, EntryNotFoundError
from compile_cache.key import missing_isa_features
from compile_cache.lock import LockTimeoutError, key_lock
from compile_cache.manifest import MANIFEST_NAME, Manifest, ManifestError
from compile_cache.store import CompileCache, default_cache_root


def _dirs(cache: CompileCache, namespace: str) -> list[str]:
    return sorted(p.name for p in (cache.root / namespace).iterdir())


def test_miss_compiles_then_hit_reuses(tmp_path: Path, inputs, compile_fn, caplog) -> None:
    caplog.set_level(logging.INFO, logger="compile_cache")
    cache = CompileCache(tmp_path)
    assert cache.lookup(inputs) is None
    first = cache.get_or_compile(inputs, compile_fn)
    second = cache.get_or_compile(inputs, compile_fn)
    assert compile_fn.calls == 1
    assert first.path == second.path == tmp_path / "cpu-2.5.1" / inputs.key()
    assert first.files == ["model.pt2", "neff/bucket_128.neff"]
    assert first.file("model.pt2").read_bytes() == compile_fn.payload
    assert first.inputs == inputs and first.size == len(compile_fn.payload) + 200
    manifest = json.loads((first.path / MANIFEST_NAME).read_text())
    assert manifest["key"] == inputs.key() and manifest["inputs"] == inputs.describe()
    assert manifest["files"]["model.pt2"]["size"] == len(compile_fn.payload)
    assert manifest["tool"]["name"] == "neuron-lmi" and manifest["created"]
    assert f"miss key={inputs.key()}" in caplog.text and f"hit key={inputs.key()}" in caplog.text
    assert _dirs(cache, "cpu-2.5.1") == [inputs.key(), f"{inputs.key()}.lock"]  # no staging left
    assert cache.lookup(inputs) == first


def test_other_inputs_get_their_own_entry(tmp_path: Path, make_key_inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path)
    a = cache.get_or_compile(make_key_inputs(), compile_fn)
    b = cache.get_or_compile(make_key_inputs(tensor_parallel_degree=2), compile_fn)
    assert compile_fn.calls == 2 and a.path != b.path
    assert [e.key for e in cache.list()] == [a.key, b.key]


def test_failed_compile_leaves_nothing(tmp_path: Path, inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path)

    def broken(out: Path) -> None:
        (out / "half.neff").write_bytes(b"x")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get_or_compile(inputs, broken)
    assert cache.lookup(inputs) is None
    assert _dirs(cache, "cpu-2.5.1") == [f"{inputs.key()}.lock"]
    cache.get_or_compile(inputs, compile_fn)
    assert compile_fn.calls == 1


def test_compile_writing_nothing_is_an_error(tmp_path: Path, inputs) -> None:
    with pytest.raises(CacheError, match="wrote no files"):
        CompileCache(tmp_path).get_or_compile(inputs, lambda out: None)


def test_corrupt_byte_is_named_moved_aside_and_recompiled(tmp_path: Path, inputs, compile_fn, caplog) -> None:
    cache = CompileCache(tmp_path)
    entry = cache.get_or_compile(inputs, compile_fn)
    artifact = entry.path / "neff" / "bucket_128.neff"
    data = bytearray(artifact.read_bytes())
    data[17] ^= 0xFF
    artifact.write_bytes(bytes(data))

    report = cache.verify(inputs.key())
    assert not report.ok and report.mismatched == ("neff/bucket_128.neff",)
    assert any("neff/bucket_128.neff" in p for p in report.problems)

    caplog.set_level(logging.INFO, logger="compile_cache")
    again = cache.get_or_compile(inputs, compile_fn)
    assert compile_fn.calls == 2 and cache.verify(again.key).ok
    assert f"damaged cache entry key={inputs.key()}" in caplog.text and "neff/bucket_128.neff" in caplog.text
    corrupt = [n for n in _dirs(cache, "cpu-2.5.1") if ".corrupt-" in n]
    assert len(corrupt) == 1 and corrupt[0].startswith(inputs.key())


DAMAGES = ["delete", "truncate_manifest", "garbage_manifest", "extra", "edit_inputs"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_damage_is_detected_and_recompiled(tmp_path: Path, inputs, compile_fn, damage: str) -> None:
    cache = CompileCache(tmp_path)
    entry = cache.get_or_compile(inputs, compile_fn)
    manifest = entry.path / MANIFEST_NAME
    if damage == "delete":
        (entry.path / "model.pt2").unlink()
    elif damage == "truncate_manifest":
        manifest.write_bytes(manifest.read_bytes()[:40])
    elif damage == "garbage_manifest":
        manifest.write_bytes(b"\x00\xff not json")
    elif damage == "extra":
        (entry.path / "stray.neff").write_bytes(b"?")
    else:
        raw = json.loads(manifest.read_text())
        raw["inputs"]["batch_size"] = 64
        manifest.write_text(json.dumps(raw))
    report = cache.verify(inputs.key())
    assert not report.ok
    if damage == "delete":
        assert report.missing == ("model.pt2",)
    elif damage == "extra":
        assert report.unexpected == ("stray.neff",)
    else:
        assert report.manifest_error
    assert cache.lookup(inputs) is None  # never loaded; moved aside
    assert cache.get_or_compile(inputs, compile_fn).key == inputs.key()
    assert compile_fn.calls == 2


def test_no_compile(tmp_path: Path, inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path)
    with pytest.raises(CacheMissError, match=inputs.key()):
        cache.get_or_compile(inputs, compile_fn, no_compile=True)
    entry = cache.get_or_compile(inputs, compile_fn)
    assert cache.get_or_compile(inputs, compile_fn, no_compile=True) == entry
    (entry.path / "model.pt2").write_bytes(b"truncated")
    with pytest.raises(CorruptEntryError, match=rf"{inputs.key()}.*model\.pt2"):
        cache.get_or_compile(inputs, compile_fn, no_compile=True)
    assert compile_fn.calls == 1


def test_size_only_lookups(tmp_path: Path, inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path, checksums=False)
    entry = cache.get_or_compile(inputs, compile_fn)
    (entry.path / "model.pt2").write_bytes(b"X" * entry.manifest.files["model.pt2"].size)
    assert cache.lookup(inputs) is not None  # same size: only verify() (always SHA-256) catches it
    assert not cache.verify(inputs.key()).ok


def test_show_list_and_prefixes(tmp_path: Path, inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path)
    assert cache.list() == []
    entry = cache.get_or_compile(inputs, compile_fn)
    assert cache.show(inputs.key()[:8]) == entry
    with pytest.raises(EntryNotFoundError):
        cache.show("abcdef")
    with pytest.raises(ValueError, match="6 hex"):
        cache.show("ab")
    (entry.path / MANIFEST_NAME).write_text("{")
    assert cache.list() == []  # unreadable manifests are not listed (verify reports them)
    with pytest.raises(CorruptEntryError, match="not valid JSON"):
        cache.show(inputs.key())


def test_manifest_rejects_paths_outside_the_entry(tmp_path: Path, inputs, compile_fn) -> None:
    entry = CompileCache(tmp_path).get_or_compile(inputs, compile_fn)
    raw = json.loads((entry.path / MANIFEST_NAME).read_text())
    for bad in ("../evil", "/etc/passwd", "a/../../b", MANIFEST_NAME):
        raw["files"] = {bad: {"size": 1, "sha256": "0" * 64}}
        with pytest.raises(ManifestError):
            Manifest.parse(json.dumps(raw).encode())


def test_lock_timeout(tmp_path: Path, inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path, lock_timeout=0.3)
    with (
        key_lock(tmp_path / inputs.namespace / f"{inputs.key()}.lock", timeout=1),
        pytest.raises(LockTimeoutError),
    ):
        cache.get_or_compile(inputs, compile_fn)
    assert compile_fn.calls == 0


def test_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NEURON_LMI_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "neuron-lmi" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "neuron-lmi" / "compile"
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "moved"))
    assert default_cache_root() == CompileCache().root == tmp_path / "moved"


def _age(path: Path, days: float) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then))


def test_prune_by_age_uses_last_use(tmp_path: Path, make_key_inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path)
    old, fresh, used = (cache.get_or_compile(make_key_inputs(batch_size=b), compile_fn) for b in (1, 2, 3))
    for e in (old, used):
        _age(e.path, 10)
    assert cache.lookup(used.inputs) is not None  # a hit refreshes last use
    report = cache.prune(older_than=timedelta(days=7))
    assert report.removed == (old.key,) and report.kept == 2 and report.freed_bytes > 0
    assert sorted(e.key for e in cache.list()) == sorted([fresh.key, used.key])
    assert not (old.path.parent / f"{old.key}.lock").exists()


def test_prune_by_size_removes_least_recently_used(tmp_path: Path, make_key_inputs, make_compile) -> None:
    cache = CompileCache(tmp_path)
    fn = make_compile(payload=b"x" * 10_000)
    entries = [cache.get_or_compile(make_key_inputs(batch_size=b), fn) for b in (1, 2, 3)]
    for days, e in zip((3, 1, 2), entries, strict=True):
        _age(e.path, days)
    one = entries[0].size + len((entries[0].path / MANIFEST_NAME).read_bytes())
    report = cache.prune(max_size=2 * one + 10)
    assert report.removed == (entries[0].key,)
    report = cache.prune(max_size=0)
    assert report.removed == (entries[2].key, entries[1].key) and cache.list() == []


def test_prune_skips_locked_entries_and_cleans_leftovers(tmp_path: Path, inputs, compile_fn) -> None:
    cache = CompileCache(tmp_path)
    entry = cache.get_or_compile(inputs, compile_fn)
    (entry.path / "model.pt2").write_bytes(b"broken")
    assert cache.lookup(inputs) is None  # moved aside as .corrupt-…
    entry = cache.get_or_compile(inputs, compile_fn)
    abandoned = entry.path.parent / ".tmp-ffffffffffffffffffffffff-abc"
    abandoned.mkdir()
    with key_lock(entry.path.parent / f"{inputs.key()}.lock", timeout=1):
        report = cache.prune(max_size=0)
    assert report.skipped_locked == (inputs.key(),) and report.removed == ()
    assert len(report.leftovers) == 2 and not abandoned.exists()
    assert _dirs(cache, "cpu-2.5.1") == [inputs.key(), f"{inputs.key()}.lock"]
    with pytest.raises(ValueError, match="older_than"):
        cache.prune()


def test_entry_appears_only_when_complete(tmp_path: Path, inputs) -> None:
    cache = CompileCache(tmp_path)
    final = tmp_path / inputs.namespace / inputs.key()
    seen: list[Path] = []

    def compile_fn(out: Path) -> None:
        seen.append(out)
        assert out.parent == final.parent and out.name.startswith(f".tmp-{inputs.key()}-")
        (out / "a.bin").write_bytes(b"a")
        assert not final.exists() and cache.lookup(inputs) is None  # invisible while being written

    entry = cache.get_or_compile(inputs, compile_fn)
    assert entry.path == final and not seen[0].exists() and (final / MANIFEST_NAME).is_file()


def test_an_entry_built_with_more_features_is_a_miss_on_a_host_with_fewer(
    tmp_path: Path, make_key_inputs, make_compile
) -> None:
    """A package shared through the store by an AMX host is never handed to a host without AMX: the
    features are in the key, so the other host misses and compiles its own."""
    amx_host = ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512_f", "fma3")
    zen_host = ("avx2", "avx512_bf16", "avx512_f", "fma3")
    cache = CompileCache(tmp_path)
    amx_build = cache.get_or_compile(make_key_inputs(isa_features=amx_host), make_compile())
    assert cache.lookup(make_key_inputs(isa_features=zen_host)) is None
    zen_compile = make_compile()
    zen_build = cache.get_or_compile(make_key_inputs(isa_features=zen_host), zen_compile)
    assert zen_compile.calls == 1 and zen_build.key != amx_build.key
    assert zen_build.inputs.isa_features == zen_host
    assert missing_isa_features(amx_build.inputs, zen_host) == ("amx_bf16", "amx_tile")
    assert cache.lookup(make_key_inputs(isa_features=amx_host)) == amx_build  # still the AMX host's
