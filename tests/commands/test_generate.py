"""``neuron-lmi generate`` as a user runs it: a subprocess, text on stdout, errors on stderr; its
engine configured as ``serve``'s is (serving.properties, ``OPTION_*``, the flags on top)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams

# Configuration this host's environment may hold; each test says what it sets.
CONFIG_VARS = ("OPTION_", "SERVING_", "SM_", "HF_MODEL_ID", "TENSOR_PARALLEL_DEGREE", "MAX_BATCH_SIZE")


def cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``neuron-lmi generate ARGS`` with ``env`` as its only configuration variables (no SageMaker
    folder either)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(CONFIG_VARS)}
    clean["NEURON_LMI_SAGEMAKER_ROOT"] = os.devnull  # not a folder: no /opt/ml/model/serving.properties
    return subprocess.run(
        [sys.executable, "-m", "neuron_lmi.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **(env or {})},
    )


def test_greedy_text_only_on_stdout_matches_the_engine(tiny_llama_dir: Path) -> None:
    prompt = "The weather today"
    args = ("--model", str(tiny_llama_dir), "--max-new-tokens", "12", "--temperature", "0", "--dtype", "fp32")
    done = cli(*args, "--enforce-eager", prompt)
    assert done.returncode == 0, done.stderr
    llm = LLM(str(tiny_llama_dir), env={}, dtype="fp32", enforce_eager=True, max_rolling_batch_size=1)
    expected = llm.generate(prompt, SamplingParams(max_new_tokens=12))[0]
    assert done.stdout == expected.text + "\n"
    assert "INFO" not in done.stdout and "CPU engine" in done.stderr  # logs go to stderr


def test_chat_template_and_seeded_sampling_are_reproducible(tiny_llama_dir: Path) -> None:
    args = ("--model", str(tiny_llama_dir), "--max-new-tokens", "8", "--temperature", "0.9", "--seed", "3")
    first, second = cli(*args, "--chat", "Hi"), cli(*args, "--chat", "Hi")
    assert first.returncode == 0 and first.stdout == second.stdout and first.stdout.strip()


def test_bad_input_exits_non_zero_with_a_message(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad_top_p = cli("--model", str(tiny_llama_dir), "--top-p", "1.5", "x")
    assert bad_top_p.returncode != 0 and "top_p" in bad_top_p.stderr and bad_top_p.stdout == ""
    missing = cli("--model", str(tmp_path / "nope"), "x")
    assert missing.returncode != 0 and "nope" in missing.stderr
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    broken = cli("--model", str(corrupt), "x")
    assert broken.returncode != 0 and "broken.gguf" in broken.stderr


def test_serving_properties_and_environment_configure_it_as_serve(tiny_llama_properties: Path) -> None:
    """serving.properties wins over the environment (LMI's order): its 3 rows, the environment's
    positions; a flag wins over both. The engine's start-up line on stderr says what it runs."""
    env = {"OPTION_MAX_ROLLING_BATCH_SIZE": "5", "OPTION_N_POSITIONS": "96"}
    done = cli("--properties", str(tiny_llama_properties), "--max-new-tokens", "2", "hi", env=env)
    assert done.returncode == 0, done.stderr
    assert "3 rows x 96 positions (configured), dtype fp32" in done.stderr
    told = cli(
        "--properties",
        str(tiny_llama_properties),
        "--n-positions",
        "64",
        "--max-new-tokens",
        "2",
        "hi",
        env=env,
    )
    assert told.returncode == 0 and "3 rows x 64 positions" in told.stderr


def test_one_row_unless_a_source_sets_the_rows(tiny_llama_dir: Path) -> None:
    args = ("--model", str(tiny_llama_dir), "--enforce-eager", "--max-new-tokens", "2", "hi")
    done = cli(*args, env={"OPTION_N_POSITIONS": "80"})
    assert done.returncode == 0 and "1 rows x 80 positions" in done.stderr, done.stderr
    rows = cli(*args, env={"OPTION_N_POSITIONS": "80", "OPTION_MAX_ROLLING_BATCH_SIZE": "2"})
    assert rows.returncode == 0 and "2 rows x 80 positions" in rows.stderr, rows.stderr


def test_a_bad_configuration_value_is_named(tiny_llama_properties: Path) -> None:
    bad = cli("--properties", str(tiny_llama_properties), "hi", env={"OPTION_N_POSITIONS": "0"})
    assert bad.returncode == 2 and "OPTION_N_POSITIONS" in bad.stderr and bad.stdout == ""
