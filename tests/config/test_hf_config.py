"""The one ``config.json`` reader: a checkpoint folder's or a named file's, errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_lmi.config.hf_config import max_position_embeddings, read_hf_config, read_hf_config_file


def test_reads_a_folder_or_a_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert read_hf_config(tmp_path, "test") == read_hf_config_file(tmp_path / "config.json", "test")
    assert max_position_embeddings(read_hf_config(tmp_path, "test")) == 8192
    assert max_position_embeddings({"max_position_embeddings": 0}) is None
    assert max_position_embeddings({}) is None
    gemma3_vl = {"model_type": "gemma3", "text_config": {"max_position_embeddings": 131072}}
    assert max_position_embeddings(gemma3_vl) == 131072  # served text-only: the language model's


@pytest.mark.parametrize(
    ("text", "match"),
    [(None, "needs a Hugging Face checkpoint"), ("{", "not valid JSON"), ("[]", "JSON object")],
)
def test_errors_name_who_or_the_file(tmp_path: Path, text: str | None, match: str) -> None:
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        read_hf_config(tmp_path, "the test")
