"""Two real processes asking for the same key at once compile it once; a dead holder frees the lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import json, logging, sys, time
    from pathlib import Path
    from compile_cache.key import CacheKeyInputs
    from compile_cache.store import CompileCache

    root, counter, me, other = (Path(a) for a in sys.argv[1:5])
    inputs = CacheKeyInputs(architecture={"model_type": "llama"}, target="cpu", compiler="torch-aotinductor",
                            compiler_version="2.5.1", n_positions=256, context_buckets=(128,),
                            token_buckets=(256,), dtype="fp32")

    def compile_fn(out):
        with counter.open("a") as fh:  # O_APPEND: one line per compile, from any process
            fh.write(f"{me.name}\\n")
        time.sleep(1.0)  # long enough that the other process surely asks while this one compiles
        (out / "graph.bin").write_bytes(b"graph" * 1000)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    me.touch()
    deadline = time.monotonic() + 30
    while not other.exists() and time.monotonic() < deadline:  # start together
        time.sleep(0.01)
    entry = CompileCache(root, lock_timeout=60).get_or_compile(inputs, compile_fn)
    size = len(entry.file("graph.bin").read_bytes())
    print(json.dumps({"key": entry.key, "path": str(entry.path), "data": size}))
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_two_processes_compile_once(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root, counter = tmp_path / "cache", tmp_path / "compiles.txt"
    a, b = tmp_path / "ready-a", tmp_path / "ready-b"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), str(counter), str(me), str(other)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_env(),
        )
        for me, other in ((a, b), (b, a))
    ]
    results, logs = [], []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
        logs.append(err)
    assert len(counter.read_text().splitlines()) == 1  # compiled exactly once
    assert results[0] == results[1] and results[0]["data"] == 5000
    waited = [log for log in logs if "waiting for lock" in log]
    assert len(waited) == 1 and f"hit key={results[0]['key']}" in waited[0]  # the other one waited, reused
    assert not [n for n in os.listdir(Path(results[0]["path"]).parent) if n.startswith(".tmp-")]


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from compile_cache.lock import key_lock
    with key_lock(Path(sys.argv[1]), timeout=5):
        print("locked", flush=True)
        time.sleep(60)
    """
)


def test_lock_of_a_killed_process_is_released(tmp_path: Path, inputs, compile_fn) -> None:
    from compile_cache.store import CompileCache

    cache = CompileCache(tmp_path / "cache", lock_timeout=20)
    lock = cache.root / inputs.namespace / f"{inputs.key()}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True, cwd=REPO, env=_env()
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)  # a compile that crashed while holding the lock
        entry = cache.get_or_compile(inputs, compile_fn)
        assert compile_fn.calls == 1 and entry.key == inputs.key()
        assert time.monotonic() - started < 10
    finally:
        holder.kill()
        holder.wait()
