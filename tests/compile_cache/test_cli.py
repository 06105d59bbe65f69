"""``neuron-lmi cache``: outputs and exit codes, through ``neuron_lmi.cli.main`` and one real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from compile_cache.key import CacheKeyInputs, fingerprint_weights
from compile_cache.store import CompileCache
from neuron_lmi.cli import main
from neuron_lmi.commands.cache import parse_duration, parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "_name_or_path": "/somewhere/else",
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return d


def _key(capsys, *args: str) -> dict:
    assert main(["cache", "key", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cache_key_prints_key_and_inputs_without_compiling(tmp_path: Path, model_dir: Path, capsys) -> None:
    cache_dir = tmp_path / "cache"
    args = ["--model", str(model_dir), "--cache-dir", str(cache_dir), "--compiler-version", "2.5.1"]
    out = _key(capsys, *args)
    inputs = CacheKeyInputs.from_description(out["inputs"])
    assert out["key"] == inputs.key() and out["present"] is False and not cache_dir.exists()
    assert out["namespace"] == "cpu-2.5.1" and out["path"] == str(cache_dir / "cpu-2.5.1" / out["key"])
    assert inputs.n_positions == 4096  # min(max_position_embeddings, 4096)
    assert inputs.token_buckets == (128, 256, 512, 1024, 2048, 4096)
    assert inputs.context_buckets == (64, 128, 256, 512, 1024, 2048)
    assert inputs.dtype == "bf16" and inputs.batch_size == 32 and inputs.compiler == "torch-aotinductor"
    assert "_name_or_path" not in inputs.architecture and inputs.weights_fingerprint is None

    assert main(["cache", "key", *args]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"key        {out['key']}\n") and "(absent)" in text
    assert '"n_positions": 4096' in text


def test_cache_key_flags_change_the_key(model_dir: Path, capsys) -> None:
    base = ["--model-config", str(model_dir / "config.json"), "--compiler-version", "2.19.0"]
    keys = {
        _key(capsys, *base)["key"],
        _key(capsys, *base, "--target", "neuron")["key"],
        _key(capsys, *base, "--tensor-parallel-degree", "2")["key"],
        _key(capsys, *base, "--max-rolling-batch-size", "8")["key"],
        _key(capsys, *base, "--n-positions", "2048")["key"],
        _key(capsys, *base, "--dtype", "fp16")["key"],
        _key(capsys, *base, "--group-query-attention", "replicated-heads")["key"],
        _key(capsys, *base, "--context-length-estimate", "128,1024")["key"],
        _key(capsys, *base, "--compiler-flags", "-O2 --auto-cast=none")["key"],
    }
    assert len(keys) == 9
    out = _key(capsys, *base, "--target", "neuron", "--context-length-estimate", "1024,128")
    assert out["inputs"]["context_buckets"] == [128, 1024] and out["namespace"] == "neuron-2.19.0"


def test_cache_key_weights_fingerprint(model_dir: Path, capsys) -> None:
    out = _key(capsys, "--model", str(model_dir), "--compiler-version", "1", "--weights", "content")
    assert out["inputs"]["weights_fingerprint"] == fingerprint_weights(model_dir)
    config = str(model_dir / "config.json")
    assert main(["cache", "key", "--model-config", config, "--weights", "content"]) == 2
    assert "--weights: needs --model" in capsys.readouterr().err


def test_cache_key_errors(tmp_path: Path, model_dir: Path, capsys) -> None:
    assert main(["cache", "key", "--model", str(tmp_path / "nope")]) == 2
    assert "config.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["cache", "key", "--model-config", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    cfg = str(model_dir / "config.json")
    assert main(["cache", "key", "--model-config", cfg, "--dtype", "int4", "--compiler-version", "1"]) == 2
    assert "dtype" in capsys.readouterr().err
    too_long = ["--n-positions", "2048", "--context-length-estimate", "4096", "--compiler-version", "1"]
    assert main(["cache", "key", "--model-config", cfg, *too_long]) == 2
    err = capsys.readouterr().err
    assert "context_buckets" in err and "n_positions=2048" in err
    with pytest.raises(SystemExit):  # argparse: --model or --model-config is required
        main(["cache", "key"])


def test_list_show_verify(tmp_path: Path, inputs, compile_fn, capsys) -> None:
    cache_dir = str(tmp_path)
    assert main(["cache", "list", "--cache-dir", cache_dir]) == 0
    assert "no entries" in capsys.readouterr().out
    entry = CompileCache(tmp_path).get_or_compile(inputs, compile_fn)

    assert main(["cache", "list", "--cache-dir", cache_dir]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(entry.key) and "cpu-2.5.1" in line and "tp=1 bs=4 n_pos=512 bf16" in line
    assert main(["cache", "list", "--cache-dir", cache_dir, "--json"]) == 0
    assert [e["key"] for e in json.loads(capsys.readouterr().out)] == [entry.key]

    assert main(["cache", "show", entry.key[:8], "--cache-dir", cache_dir]) == 0
    text = capsys.readouterr().out
    assert f"key      {entry.key}" in text and "neff/bucket_128.neff" in text
    assert main(["cache", "show", entry.key, "--cache-dir", cache_dir, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"] == inputs.describe()
    assert main(["cache", "show", "abcdef", "--cache-dir", cache_dir]) == 2
    assert "no entry with key abcdef" in capsys.readouterr().err

    assert main(["cache", "verify", "--cache-dir", cache_dir]) == 0
    assert capsys.readouterr().out.strip() == f"{entry.key}  ok"
    (entry.path / "model.pt2").write_bytes(b"flipped")
    assert main(["cache", "verify", entry.key, "--cache-dir", cache_dir]) == 1
    assert "DAMAGED: wrong size or checksum: model.pt2" in capsys.readouterr().out
    assert main(["cache", "verify", "--cache-dir", cache_dir, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["mismatched"] == ["model.pt2"]
    assert main(["cache", "push", "--cache-dir", cache_dir]) == 2  # no --cache-url


def test_prune(tmp_path: Path, make_key_inputs, compile_fn, capsys) -> None:
    cache = CompileCache(tmp_path)
    old = cache.get_or_compile(make_key_inputs(batch_size=1), compile_fn)
    new = cache.get_or_compile(make_key_inputs(batch_size=2), compile_fn)
    then = old.path.stat().st_mtime - 8 * 86400
    os.utime(old.path, (then, then))
    assert main(["cache", "prune", "--older-than", "7d", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {old.key}" in out and "1 entries kept" in out
    assert main(["cache", "prune", "--max-size", "0", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [new.key]
    assert main(["cache", "prune", "--cache-dir", str(tmp_path)]) == 2
    assert main(["cache", "prune", "--older-than", "soon", "--cache-dir", str(tmp_path)]) == 2
    assert "--older-than" in capsys.readouterr().err


def test_parsers() -> None:
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("12h") == timedelta(hours=12) and parse_duration("90") == timedelta(seconds=90)
    assert parse_size("10G") == 10 * 1024**3 and parse_size("1.5GiB") == int(1.5 * 1024**3)
    assert parse_size("500m") == 500 * 1024**2 and parse_size("2048") == 2048
    for bad in ("", "10X", "-1G"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_real_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "NEURON_LMI_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_lmi.cli", "cache", "verify", "abcdef"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and f"no entry with key abcdef under {tmp_path}" in proc.stderr


def test_show_and_verify_say_whether_an_entry_runs_on_this_host(
    tmp_path: Path, make_key_inputs, compile_fn, capsys
) -> None:
    from neuron_lmi.models import host_isa

    here = host_isa.isa_features()
    cache = CompileCache(tmp_path)
    local = cache.get_or_compile(make_key_inputs(isa_features=here), compile_fn)
    elsewhere = make_key_inputs(isa_features=(*here, "amx_tile_from_elsewhere"))
    foreign = cache.get_or_compile(elsewhere, compile_fn)
    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 0  # intact, if not for this host
    lines = dict(line.split("  ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert lines[local.key].startswith("ok  isa ") and lines[local.key].endswith("(runs on this host)")
    assert lines[foreign.key].endswith("(NOT on this host: it lacks amx_tile_from_elsewhere)")
    assert main(["cache", "show", foreign.key, "--cache-dir", str(tmp_path), "--json"]) == 0
    isa = json.loads(capsys.readouterr().out)["isa"]
    assert isa["missing_here"] == ["amx_tile_from_elsewhere"] and set(here) < set(isa["features"])
    neuron = cache.get_or_compile(make_key_inputs(target="neuron"), compile_fn)
    assert main(["cache", "show", neuron.key, "--cache-dir", str(tmp_path)]) == 0
    assert "isa " not in capsys.readouterr().out  # a Neuron artifact names no CPU features
