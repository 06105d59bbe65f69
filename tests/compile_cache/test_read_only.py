"""A store the process cannot write (SageMaker's read-only ``/opt/ml/model``): used in place, never written.

The end-to-end test runs the cache code in a subprocess that really cannot write the store, two ways:
* unprivileged: tests run as root here, and root ignores mode bits, so the subprocess imports what it
  needs and then drops to uid/gid 65534 (``nobody``) before touching the root-owned, world-readable
  store (run as another user, the store is made read-only with ``chmod`` instead): ``EACCES``;
* as SageMaker runs it: root, with the store bind-mounted read-only in a private mount namespace
  (``unshare --mount``; skipped where that is not allowed): ``EROFS``.
Either way the subprocess first checks that creating a file in the store fails, so the condition is
real, not assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from compile_cache import CompileCache, CorruptEntryError, is_writable_dir, open_store
from tests.compile_cache.conftest import CountingCompile, make_inputs

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
MATCHING = {}
MISSING = {"batch_size": 8}  # no entry for these inputs in the read-only store
DAMAGED = {"dtype": "fp32"}  # an entry whose artifact was changed after it was written

# Runs in the subprocess: imports first (the interpreter may live where nobody can read), then
# drops privileges, then uses the read-only store the way ``serve`` does (``cache_for``).
WORKER = """
import errno, json, logging, os, sys
from pathlib import Path
from compile_cache import CorruptEntryError
from neuron_lmi.backends.common import cache_for
from tests.compile_cache.conftest import CountingCompile, make_inputs

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
store, cases, uid = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
try:
    (store / "probe").write_text("x")
    probe = "written"
except OSError as exc:
    probe = errno.errorcode[exc.errno]
cache = cache_for(str(store))
out = {"probe": probe, "root": str(cache.root), "seeds": [str(s) for s in cache.seeds]}
for name, overrides in cases.items():
    compile_fn = CountingCompile()
    entry = cache.get_or_compile(make_inputs(**overrides), compile_fn)
    out[name] = {"path": str(entry.path), "compiled": compile_fn.calls}
try:
    cache.get_or_compile(make_inputs(**cases["damaged"]), CountingCompile(), no_compile=True)
    out["no_compile"] = "served"  # the copy compiled above into the writable root
except CorruptEntryError as exc:
    out["no_compile"] = str(exc)
print(json.dumps(out))
"""


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with (mode, size, mtime_ns): any write, rename or lock file shows."""
    out = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        out[path.relative_to(root).as_posix()] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return out


def _set_tree_mode(root: Path, dirs: int, files: int) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(dirs if path.is_dir() else files)


@pytest.fixture()
def shared_base() -> Iterator[Path]:
    """A folder outside pytest's private (0700) tmp tree, so another user can reach it."""
    base = Path(tempfile.mkdtemp(prefix="neuron-lmi-ro-test-"))
    base.chmod(0o755)
    yield base
    _set_tree_mode(base, 0o755, 0o644)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture()
def read_only_store(shared_base: Path) -> Path:
    """A store as ``neuron-lmi package --compiled`` ships it: one good entry, one damaged entry."""
    store = shared_base / "opt" / "ml" / "model" / "compiled"
    cache = CompileCache(store)
    cache.get_or_compile(make_inputs(**MATCHING), CountingCompile())
    damaged = cache.get_or_compile(make_inputs(**DAMAGED), CountingCompile())
    (damaged.path / "model.pt2").write_bytes(b"changed after the manifest was written")
    for lock in store.rglob("*.lock"):  # what a build machine leaves behind is not shipped
        lock.unlink()
    _set_tree_mode(shared_base, 0o755, 0o644)
    return store


# ``$0`` is the store: bind-mount it read-only over itself in a private mount namespace, then run.
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'


def _worker_command(store: Path, how: str) -> list[str]:
    cases = json.dumps({"matching": MATCHING, "missing": MISSING, "damaged": DAMAGED})
    uid = NOBODY if how == "nobody" else -1
    python = [sys.executable, "-c", WORKER, str(store), cases, str(uid)]
    if how != "read-only-mount":
        return python
    unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT, str(store)]
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare(1)")
    check = subprocess.run([*unshare, "true"], capture_output=True, text=True, timeout=30, check=False)
    if check.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {check.stderr.strip()}")
    return [*unshare, *python]


@pytest.mark.parametrize(
    ("how", "cache_dir_var"),
    [
        ("unprivileged", True),  # uid 65534 (or chmod 0555 when not root): EACCES
        ("unprivileged", False),
        ("read-only-mount", True),  # root, as SageMaker runs the container, on a read-only mount: EROFS
        ("read-only-mount", False),
    ],
)
def test_unwritable_store_serves_in_place_and_compiles_elsewhere(
    read_only_store: Path, shared_base: Path, how: str, cache_dir_var: bool
) -> None:
    as_root = os.geteuid() == 0
    if how == "unprivileged":
        how = "nobody" if as_root else "chmod"
    writable, tmp, home = shared_base / "writable", shared_base / "tmp", shared_base / "home"
    for folder in (writable, tmp, home):
        folder.mkdir()
        if how == "nobody":
            os.chown(folder, NOBODY, NOBODY)
    if how == "chmod":
        _set_tree_mode(shared_base / "opt", 0o555, 0o444)
    env = {k: v for k, v in os.environ.items() if k not in ("NEURON_LMI_CACHE_DIR", "XDG_CACHE_HOME")}
    # nobody's home (/nonexistent) has no ~/.cache to fall back to: the compiles go to the temp dir
    env.update(TMPDIR=str(tmp), HOME="/nonexistent" if how == "nobody" else str(home))
    if cache_dir_var:
        env["NEURON_LMI_CACHE_DIR"] = str(writable)
    if cache_dir_var:
        expected_root = writable
    elif how == "nobody":
        expected_root = tmp / f"neuron-lmi-compile-{NOBODY}"
    else:
        expected_root = home / ".cache" / "neuron-lmi" / "compile"
    command = _worker_command(read_only_store, how)
    before = _snapshot(read_only_store)

    done = subprocess.run(
        command,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    assert "OSError" not in done.stderr and "Error:" not in done.stderr, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    expected_probe = "EROFS" if how == "read-only-mount" else "EACCES"
    assert out["probe"] == expected_probe, "the test process could write the store"
    assert (Path(out["root"]), out["seeds"]) == (expected_root, [str(read_only_store)])
    # a matching entry is served from the read-only folder itself, without compiling
    assert out["matching"]["compiled"] == 0
    assert Path(out["matching"]["path"]).parent.parent == read_only_store
    # a miss and a damaged entry compile into the writable store
    for case in ("missing", "damaged"):
        assert out[case]["compiled"] == 1
        assert Path(out[case]["path"]).is_relative_to(expected_root)
    assert out["no_compile"] == "served"
    # nothing was written to the read-only store: no lock, staging folder, quarantine or use time
    assert _snapshot(read_only_store) == before
    assert "damaged read-only cache entry" in done.stderr and "left in place" in done.stderr


def test_seed_entries_are_read_in_place_and_never_touched(tmp_path: Path, compile_fn) -> None:
    seed = tmp_path / "seed"
    good = CompileCache(seed).get_or_compile(make_inputs(), CountingCompile())
    bad = CompileCache(seed).get_or_compile(make_inputs(**DAMAGED), CountingCompile())
    (bad.path / "model.pt2").write_bytes(b"truncated")
    before = _snapshot(seed)
    cache = CompileCache(tmp_path / "root", seeds=[seed])

    assert cache.lookup(make_inputs()) == good
    assert cache.get_or_compile(make_inputs(), compile_fn) == good
    with pytest.raises(CorruptEntryError, match=r"left in place; not recompiling"):
        cache.get_or_compile(make_inputs(**DAMAGED), compile_fn, no_compile=True)
    rebuilt = cache.get_or_compile(make_inputs(**DAMAGED), compile_fn)
    assert rebuilt.path.is_relative_to(tmp_path / "root") and compile_fn.calls == 1
    assert cache.get_or_compile(make_inputs(**DAMAGED), compile_fn, no_compile=True) == rebuilt
    assert _snapshot(seed) == before  # not quarantined, no lock file, mtime unchanged


def test_open_store_layers_only_when_the_root_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "writable"))
    plain = open_store(tmp_path / "not-yet-made" / "store")  # creatable: an ordinary store
    assert (plain.root, plain.seeds) == (tmp_path / "not-yet-made" / "store", ())
    assert is_writable_dir(tmp_path / "a" / "b")
    real_access = os.access
    read_only = tmp_path / "ro"
    read_only.mkdir()
    # as under a read-only mount (where os.access says no even to root)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != read_only and real_access(path, mode))
    layered = open_store(tmp_path / "ro")
    assert (layered.root, layered.seeds) == (tmp_path / "writable", (tmp_path / "ro",))


def test_neuronx_cc_cache_never_points_at_a_read_only_compiled_graph_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """neuronx-cc writes and locks in ``NEURON_COMPILE_CACHE_URL``; LMI's ``option.compiled_graph_path``
    sets it, unless that folder is read-only (then it goes beside the writable store)."""
    from neuron_lmi.backends.tnx.args import NeuronCompileSpec
    from neuron_lmi.backends.tnx.compile import neuron_cache_url, plan_neuron_compile

    real_access = os.access
    read_only = tmp_path / "opt" / "ml" / "model" / "compiled"
    read_only.mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != read_only and real_access(path, mode))
    cache = CompileCache(tmp_path / "writable", seeds=[read_only])

    def url_for(compiled_graph_path: str) -> str:
        spec = NeuronCompileSpec(str(tmp_path), 2, 4, 1024, "bf16", compiled_graph_path=compiled_graph_path)
        return plan_neuron_compile(spec, cache, {}).env["NEURON_COMPILE_CACHE_URL"]

    writable_url = str(tmp_path / "writable" / ".neuron-compile-cache")
    assert url_for(str(read_only)) == neuron_cache_url(cache) == writable_url
    assert url_for(str(tmp_path / "mine")) == str(tmp_path / "mine")  # a writable explicit path still wins
    assert url_for("s3://bucket/neff/") == "s3://bucket/neff/"
