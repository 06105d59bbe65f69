"""``neuron-lmi package``: lay out weights, compiled artifacts and serving.properties for SageMaker.

SageMaker unpacks ``model.tar.gz`` into ``/opt/ml/model`` (or copies an uncompressed S3 prefix
there), so every file sits at the archive root, exactly as ``tar -czf model.tar.gz *`` in the model
directory would make it::

    config.json  model*.safetensors  tokenizer*  serving.properties  compiled/<neff files>

``--model`` takes what ``serve`` takes: a built-in name (``smollm2``), a local folder or ``.gguf``,
``s3://…`` or a Hub id (fetched first). ``serving.properties`` is validated through
``neuron_lmi.config``: a bad value is an error naming the key; a key neuron-lmi does not know is kept
and warned about, as ``serve`` ignores it with a warning. With no ``option.model_id`` the server loads
the weights from the folder the properties file sits in; LMI's ``option.model_id=/opt/ml/model`` (the
``--container-model-dir``, for uncompressed artifacts) says the same and is kept; any other model id
would override the packaged weights and is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from neuron_lmi.config import lookup, read_properties, write_properties
from neuron_lmi.config.sources import format_properties, holds_weights, write_text_atomic

logger = logging.getLogger(__name__)

PROPERTIES_NAME = "serving.properties"
COMPILED_DIR = "compiled"
SKIPPED_NAMES = frozenset({".git", ".cache", "__pycache__", ".DS_Store", ".gitattributes"})


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "package",
        help="build a SageMaker model.tar.gz (or directory) with serving.properties",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", required=True, help="as for serve: smollm2, a local dir or .gguf, s3://..., or a Hub id"
    )
    parser.add_argument("--compiled", type=Path, help="compiled artifacts (NEFFs) to ship under compiled/")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--properties", type=Path, help="serving.properties to validate and include")
    source.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a serving.properties entry (option.x=..., x=..., or a non-option key); repeatable",
    )
    parser.add_argument("--out", required=True, type=Path, help="model.tar.gz (or .tgz), or a directory")
    parser.add_argument(
        "--container-model-dir",
        default="/opt/ml/model",
        help="where the files will be inside the container (sets option.compiled_graph_path)",
    )
    parser.add_argument("--compresslevel", type=int, default=1, choices=range(10), help="gzip level")
    parser.set_defaults(func=run)
    return parser


def _is_archive(path: Path) -> bool:
    return path.name.endswith((".tar.gz", ".tgz"))


def _walk(root: Path) -> list[tuple[Path, str]]:
    """Files under ``root`` as (source, relative posix name), skipping VCS and cache folders."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIPPED_NAMES for part in rel.parts) or path.is_dir():
            continue
        found.append((path, rel.as_posix()))
    return found


def _parse_options(pairs: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        values[key.strip()] = value.strip()
    return values


def resolve_model(model: str) -> Path:
    """The local folder or ``.gguf`` for ``--model``, named as ``serve`` names a model."""
    local = Path(model).expanduser()
    if local.exists():
        return local
    if model.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"--model {model}: no such file or directory")
    from neuron_lmi.backends.common import model_cache_dir
    from neuron_lmi.model_source import fetch_model

    return Path(fetch_model(model, model_cache_dir(os.environ)))


def collect_properties(args: argparse.Namespace, model: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The serving.properties entries to write, before validation: (known keys by their LMI names,
    unknown keys as written). Unknown keys are logged as ``serve`` logs them."""
    if args.properties is not None:
        raw = read_properties(args.properties)
    elif args.option:
        raw = _parse_options(args.option)
    elif model.is_dir() and (model / PROPERTIES_NAME).is_file():
        raw = read_properties(model / PROPERTIES_NAME)
    else:
        raw = {}
    values: dict[str, str] = {}
    unknown: dict[str, str] = {}
    for key, value in raw.items():
        spec = lookup(key)
        if spec is None:
            unknown[key] = value
        else:
            values[spec.lmi] = value
    if unknown:
        logger.warning(
            "keeping serving.properties keys neuron-lmi does not support (serve ignores them): %s",
            ", ".join(sorted(unknown)),
        )
    model_id = values.get("option.model_id")
    if model_id is not None and model_id.rstrip("/") != args.container_model_dir.rstrip("/"):
        raise ValueError(
            f"option.model_id={model_id}: the packaged weights are the model; drop option.model_id "
            f"or set it to {args.container_model_dir} (any other id would override them)"
        )
    return values, unknown


def plan_files(model: Path, compiled: Path | None) -> list[tuple[Path, str]]:
    """(source, archive name) for every file to ship; raises on a missing input or a name clash."""
    if model.is_file():
        if model.suffix != ".gguf":
            raise ValueError(f"--model {model}: expected a directory or a .gguf file")
        files = [(model, model.name)]
    elif model.is_dir():
        if not holds_weights(model):
            raise ValueError(f"--model {model}: no config.json or .gguf file in it")
        files = [(src, name) for src, name in _walk(model) if name != PROPERTIES_NAME]
    else:
        raise FileNotFoundError(f"--model {model}: no such file or directory")
    if compiled is not None:
        if not compiled.is_dir():
            raise FileNotFoundError(f"--compiled {compiled}: no such directory")
        names = {name for _, name in files}
        if any(name.split("/")[0] == COMPILED_DIR for name in names):
            raise ValueError(f"--model {model} already has a {COMPILED_DIR}/ folder; drop --compiled")
        files += [(src, f"{COMPILED_DIR}/{name}") for src, name in _walk(compiled)]
    return files


def _owner_reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_archive(out: Path, files: list[tuple[Path, str]], properties: Path, compresslevel: int) -> None:
    """``model.tar.gz`` with every member at the root; symlinks (Hub cache snapshots) are followed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w:gz", compresslevel=compresslevel, dereference=True) as tar:
        for src, name in [*files, (properties, PROPERTIES_NAME)]:
            tar.add(src, arcname=name, recursive=False, filter=_owner_reset)
    partial.replace(out)


def write_directory(out: Path, files: list[tuple[Path, str]], properties: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: directory exists and is not empty")
    for src, name in [*files, (properties, PROPERTIES_NAME)]:
        dst = out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)  # follows symlinks: the target gets real files


def run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    if model.is_dir() and args.out.resolve().is_relative_to(model.resolve()):
        raise ValueError(f"--out {args.out}: must be outside --model {args.model}")
    values, unknown = collect_properties(args, model)
    files = plan_files(model, args.compiled)
    if args.compiled is not None:
        values.setdefault(
            "option.compiled_graph_path", f"{args.container_model_dir.rstrip('/')}/{COMPILED_DIR}"
        )
    with tempfile.TemporaryDirectory(prefix="neuron-lmi-package-") as tmp:
        properties = Path(tmp) / PROPERTIES_NAME
        header = "packaged by neuron-lmi package"
        written = write_properties(values, properties, header=header)
        if unknown:  # kept for LMI, after validating the known keys
            written = {**written, **unknown}
            write_text_atomic(properties, format_properties(written, header))
        if _is_archive(args.out):
            write_archive(args.out, files, properties, args.compresslevel)
        else:
            write_directory(args.out, files, properties)
    size = sum(src.stat().st_size for src, _ in files)
    print(f"{args.out}: {len(files) + 1} files, {size / 2**20:.1f} MiB of model data")
    for key, value in written.items():
        print(f"  {key}={value}")
    return 0
