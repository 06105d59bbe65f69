"""``neuron-lmi generate`` as a user runs it: a subprocess, text on stdout, errors on stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_lmi.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_greedy_text_only_on_stdout_matches_the_engine(tiny_llama_dir: Path) -> None:
    prompt = "The weather today"
    # LLM() defaults to fp32; the command line defaults to the host's dtype (bf16 with native bf16).
    args = ("--model", str(tiny_llama_dir), "--max-new-tokens", "12", "--temperature", "0", "--dtype", "fp32")
    done = cli(*args, prompt)
    assert done.returncode == 0, done.stderr
    expected = LLM(str(tiny_llama_dir), max_rolling_batch_size=1).generate(
        prompt, SamplingParams(max_new_tokens=12)
    )[0]
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
