"""Cache keys: stable under reordering and aliases, sensitive to every field; weight fingerprints."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import fields
from pathlib import Path

import pytest

from compile_cache.key import (
    ARTIFACT_FORMAT_VERSION,
    KEY_LENGTH,
    CacheKeyInputs,
    architecture_config,
    fingerprint_weights,
    halved_context_buckets,
    missing_isa_features,
    token_generation_buckets,
)

GOLDEN = "8336fb422f41fb9e4c35c625"  # make_inputs() at ARTIFACT_FORMAT_VERSION 1

# A changed value for every field; the test below fails if a field is added without one here.
CHANGES = {
    "architecture": {"model_type": "llama", "hidden_size": 128},
    "target": "neuron",
    "compiler": "neuronx-cc",
    "compiler_version": "2.5.2",
    "n_positions": 1024,
    "context_buckets": (64, 128),
    "token_buckets": (256, 512),
    "dtype": "fp16",
    "batch_size": 8,
    "tensor_parallel_degree": 2,
    "gqa_strategy": "shard-over-heads",
    "compiler_flags": ("-O2",),
    "weights_fingerprint": "content:abc",
    "library_args": {"neuron_config": {"fused_qkv": True}},
    "isa_features": ("avx2", "fma3"),
    "format_version": ARTIFACT_FORMAT_VERSION + 1,
}


def test_key_is_stable_hex_of_documented_length(make_key_inputs) -> None:
    a, b = make_key_inputs(), make_key_inputs()
    assert a.key() == b.key() and a == b and hash(a) == hash(b)
    assert len(a.key()) == KEY_LENGTH and all(c in "0123456789abcdef" for c in a.key())
    canonical = json.dumps(a.describe(), sort_keys=True, separators=(",", ":")).encode()
    assert a.key() == hashlib.sha256(canonical).hexdigest()[:KEY_LENGTH]


def test_golden_key_pins_the_description_format(make_key_inputs) -> None:
    # If this changes, every cached artifact stops matching: bump ARTIFACT_FORMAT_VERSION on purpose.
    assert make_key_inputs().key() == GOLDEN


def test_dict_order_sequence_type_and_aliases_do_not_change_the_key(make_key_inputs) -> None:
    base = make_key_inputs(gqa_strategy="shard-over-heads", compiler_flags=("-O1", "--auto-cast=none"))
    reordered = dict(reversed(list(base.architecture.items())))
    same = make_key_inputs(
        architecture=reordered,
        context_buckets=[64, 128, 256],
        token_buckets=[128, 256, 512],
        dtype="bfloat16",
        gqa_strategy="SHARD_OVER_HEADS",
        compiler_flags=["-O1", "--auto-cast=none"],
    )
    assert same.key() == base.key()


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_every_field_changes_the_key(make_key_inputs, name: str) -> None:
    base = make_key_inputs()
    changed = make_key_inputs(**{name: CHANGES[name]})
    assert getattr(changed, name) != getattr(base, name)
    assert changed.key() != base.key()


def test_every_field_has_a_sensitivity_case() -> None:
    assert {f.name for f in fields(CacheKeyInputs)} == set(CHANGES)


def test_nested_architecture_values_change_the_key(make_key_inputs) -> None:
    a = make_key_inputs(architecture={"rope_scaling": {"type": "linear", "factor": 2.0}})
    b = make_key_inputs(architecture={"rope_scaling": {"type": "linear", "factor": 4.0}})
    assert a.key() != b.key()


def test_caller_mutation_cannot_change_a_built_key(make_key_inputs) -> None:
    arch = {"model_type": "llama", "hidden_size": 64}
    inputs = make_key_inputs(architecture=arch)
    key = inputs.key()
    arch["hidden_size"] = 4096
    assert inputs.key() == key


def test_description_round_trips(make_key_inputs) -> None:
    inputs = make_key_inputs(gqa_strategy="all-gather-heads", weights_fingerprint="content:x")
    again = CacheKeyInputs.from_description(json.loads(json.dumps(inputs.describe())))
    assert again == inputs and again.key() == inputs.key()
    with pytest.raises(ValueError, match="unknown fields"):
        CacheKeyInputs.from_description({**inputs.describe(), "extra": 1})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"target": "gpu"}, "target"),
        ({"dtype": "int3"}, "dtype"),
        ({"gqa_strategy": "sideways"}, "gqa_strategy"),
        ({"batch_size": 0}, "batch_size"),
        ({"tensor_parallel_degree": True}, "tensor_parallel_degree"),
        ({"token_buckets": (256, 128)}, "token_buckets"),
        ({"context_buckets": (64, 1024)}, "context_buckets"),
        ({"token_buckets": ()}, "token_buckets"),
        ({"compiler_version": " "}, "compiler_version"),
        ({"compiler_flags": "-O2"}, "compiler_flags"),
        ({"architecture": {"x": object()}}, "architecture"),
    ],
)
def test_invalid_inputs_name_the_field(make_key_inputs, override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_key_inputs(**override)


def test_namespace_is_target_and_safe_compiler_version(make_key_inputs) -> None:
    assert make_key_inputs().namespace == "cpu-2.5.1"
    assert make_key_inputs(target="neuron", compiler_version="2.15/x y").namespace == "neuron-2.15_x_y"


def test_architecture_config_drops_only_volatile_keys() -> None:
    cfg = {"_name_or_path": "/tmp/x", "transformers_version": "4.46.0", "hidden_size": 64}
    assert architecture_config(cfg) == {"hidden_size": 64}


def test_bucket_helpers_follow_transformers_neuronx() -> None:
    assert token_generation_buckets(2048) == (128, 256, 512, 1024, 2048)
    assert token_generation_buckets(600) == (128, 256, 512, 600)
    assert halved_context_buckets((128, 256, 512)) == (64, 128, 256)
    assert halved_context_buckets((128, 256), [512, 128]) == (128, 512)


def _write_safetensors(path: Path, values: bytes, shape: tuple[int, ...]) -> None:
    header = {"w": {"dtype": "U8", "shape": list(shape), "data_offsets": [0, len(values)]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + values)


def test_weights_fingerprint_content_and_headers(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _write_safetensors(model / "model.safetensors", b"\x01" * 16, (16,))
    content, headers = fingerprint_weights(model), fingerprint_weights(model, mode="headers")
    assert content.startswith("content:") and headers.startswith("headers:")
    assert fingerprint_weights(model) == content  # deterministic

    _write_safetensors(model / "model.safetensors", b"\x02" * 16, (16,))  # same shape, new values
    assert fingerprint_weights(model) != content
    assert fingerprint_weights(model, mode="headers") == headers  # documented blind spot

    _write_safetensors(model / "model.safetensors", b"\x02" * 16, (4, 4))  # new shape
    assert fingerprint_weights(model, mode="headers") != headers
    (model / "config.json").write_text('{"changed": true}')  # not a weight file
    assert fingerprint_weights(model, mode="headers") == fingerprint_weights(model, mode="headers")


def test_weights_fingerprint_reuses_hub_blob_names(tmp_path: Path) -> None:
    data = b"weights" * 100
    digest = hashlib.sha256(data).hexdigest()
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    (blobs / digest).write_bytes(data)
    (snap / "model.safetensors").symlink_to(blobs / digest)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(data)
    assert fingerprint_weights(snap) == fingerprint_weights(plain)


def test_weights_fingerprint_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fingerprint_weights(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors"):
        fingerprint_weights(tmp_path)
    with pytest.raises(ValueError, match="mode"):
        fingerprint_weights(tmp_path, mode="fast")


# Two hosts' features as torch's cpuinfo names them: an AMD Zen 5 and an Intel Sapphire Rapids.
ZEN5 = ("avx2", "avx512_bf16", "avx512_f", "avx512_vnni", "fma3")
AMX = ("amx_bf16", "amx_int8", "amx_tile")
SPR = (*AMX, "avx2", "avx512_bf16", "avx512_f", "avx512_fp16", "avx512_vnni", "fma3")


def test_isa_features_tell_hosts_apart_and_are_normalised(make_key_inputs) -> None:
    zen5, spr = make_key_inputs(isa_features=ZEN5), make_key_inputs(isa_features=SPR)
    assert zen5.key() != spr.key()  # ATen calls both AVX512: the features do not
    assert make_key_inputs(isa_features=("FMA3", *reversed(ZEN5))).key() == zen5.key()
    assert zen5.describe()["isa_features"] == sorted(ZEN5)
    assert CacheKeyInputs.from_description(spr.describe()) == spr
    # Neuron artifacts name none: their keys stay what they were before the field existed.
    assert "isa_features" not in make_key_inputs().describe()
    with pytest.raises(ValueError, match="isa_features"):
        make_key_inputs(isa_features="avx2 fma3")
    with pytest.raises(ValueError, match="isa_features"):
        make_key_inputs(isa_features=("avx2", " "))


def test_missing_isa_features_names_what_a_host_lacks(make_key_inputs) -> None:
    spr = make_key_inputs(isa_features=SPR)
    assert missing_isa_features(spr, ZEN5) == ("amx_bf16", "amx_int8", "amx_tile", "avx512_fp16")
    assert missing_isa_features(make_key_inputs(isa_features=ZEN5), SPR) == ()
    assert missing_isa_features(make_key_inputs(), ()) == ()  # an artifact naming none runs anywhere
