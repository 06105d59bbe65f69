"""lm-evaluation-harness against a real server on loopback: its ``local-completions`` model with
``tokenized_requests=False`` on two small local tasks (multiple choice, read from echoed prompt
log-probabilities, and ``generate_until``), checked against lm-eval's own ``hf`` model on the same
weights in fp32: the same accuracy, the same per-item log-likelihoods within 1e-3 and the same
generations.

lm-eval lives in the heavy clients' environment (``make test-clients-heavy``); without it these
tests skip. Nothing is downloaded: the tasks' data is written here, the model is the tiny random
Llama.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import ServerProcess, start_server

ROOT = Path(__file__).resolve().parents[2]
LM_EVAL = Path(os.environ.get("LM_EVAL", ROOT / ".venv-clients" / "bin" / "lm_eval"))
QUESTIONS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin"], 0),
    ("Two plus two equals", ["four", "five", "seven"], 0),
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Fahrenheit"], 0),
    ("A week has seven", ["days", "hours", "cats"], 0),
    ("The opposite of hot is", ["cold", "tall", "slow"], 0),
]
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""

pytestmark = pytest.mark.skipif(not LM_EVAL.exists(), reason=f"no {LM_EVAL} (make test-clients-heavy)")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("lm_eval_server")
    args = ["--max-rolling-batch-size", "4", "--n-positions", "256", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, args, api_key=None)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = folder / "data.jsonl"
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    (folder / "tiny_gen.yaml").write_text(GEN_TASK.format(data=data))
    return folder


def run_lm_eval(model: str, model_args: str, tasks: Path, out: Path) -> dict[str, Any]:
    """Run lm_eval; the results and each task's logged samples (by task name)."""
    args = [
        str(LM_EVAL),
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        "tiny_mc,tiny_gen",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in ("tiny_mc", "tiny_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return {"results": json.loads(results_file.read_text())["results"], "samples": samples}


def test_local_completions_equal_the_hf_model(
    server: ServerProcess, tiny_llama_dir: Path, tasks: Path, tmp_path: Path
) -> None:
    url = f"{server.url}/v1/completions"
    api_args = f"model={tiny_llama_dir},base_url={url},tokenized_requests=False,tokenizer={tiny_llama_dir}"
    api = run_lm_eval("local-completions", api_args, tasks, tmp_path / "api")
    hf = run_lm_eval("hf", f"pretrained={tiny_llama_dir},dtype=float32", tasks, tmp_path / "hf")
    assert api["results"]["tiny_mc"]["acc,none"] == hf["results"]["tiny_mc"]["acc,none"]
    for ours, ref in zip(api["samples"]["tiny_mc"], hf["samples"]["tiny_mc"], strict=True):
        got = [float(r[0]) for r in ours["filtered_resps"]]
        want = [float(r[0]) for r in ref["filtered_resps"]]
        assert got == pytest.approx(want, abs=1e-3), ours["doc"]
    generated = [r["filtered_resps"] for r in api["samples"]["tiny_gen"]]
    assert generated == [r["filtered_resps"] for r in hf["samples"]["tiny_gen"]]
    assert server.wait_rows_free() == 0
