"""``neuron-lmi plan``: which tensor-parallel degree a model needs on a Neuron instance, and why.

    neuron-lmi plan --model llama-2-70b --instance inf2.48xlarge --dtype fp16
    neuron-lmi plan --model ./my-model --json          # every instance, machine-readable
    neuron-lmi plan --model mixtral-8x7b --platform trn1  # trn1 sizes, and the NxD Inference release

Exit status: 0 with a plan; 1 when ``--instance`` is given and the model fits at no tp degree there;
2 for unknown or inconsistent inputs (the message names the offending value).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from neuron_lmi.backends.nxdi.backend import nxdi_target
from neuron_lmi.backends.nxdi.support import check_release, library_release
from neuron_lmi.backends.tnx.planner import (
    DEFAULT_HEADROOM,
    DTYPE_BYTES,
    InstancePlan,
    plan_all_instances,
    plan_instance,
)
from neuron_lmi.commands.nxdi_target import nxdi_version
from neuron_lmi.config.options import NEURON_PLATFORMS
from neuron_lmi.parallel.catalog import GIB, INSTANCES, PRESETS, ModelSpec, get_instance, load_model_spec
from neuron_lmi.parallel.head_layout import GQAStrategy

MIB = 1024**2


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="size a model per NeuronCore for every tp degree and recommend one",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}), a model directory, or a config.json",
    )
    parser.add_argument("--instance", help=f"one of {', '.join(INSTANCES)}; omitted: compare all")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES), help="weights and KV cache")
    parser.add_argument(
        "--n-positions", type=int, help="KV-cache length per row (default min(max_position_embeddings, 4096))"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="KV rows that must fit (LMI max_rolling_batch_size); shard-over-batch needs it divisible by tp",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        help="fraction of each core's HBM (16 GiB inf2/trn1, 24 GiB trn2 at LNC=2) kept free for NEFFs, "
        "activations and runtime (default 0.1)",
    )
    parser.add_argument(
        "--platform",
        choices=NEURON_PLATFORMS,
        help="compare that chip's instances only, and say which NxD Inference release serves it there",
    )
    parser.add_argument(
        "--nxdi-version",
        type=nxdi_version,
        help="the NxD Inference release (default: the installed one, else the platform's)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        model = load_model_spec(args.model)
        target = _nxdi_release(args, model)
        kwargs = {
            "dtype": args.dtype,
            "n_positions": args.n_positions,
            "batch_size": args.batch_size,
            "headroom": args.headroom,
        }
        if args.instance:
            instance = get_instance(args.instance)
            if args.platform and not instance.name.startswith(args.platform):
                raise ValueError(f"--instance {instance.name} is not a {args.platform} instance (--platform)")
            plans: tuple[InstancePlan, ...] = (plan_instance(model, instance, **kwargs),)
        else:
            plans = _plans(model, args.platform, kwargs)
    except (ValueError, RuntimeError) as exc:
        print(f"neuron-lmi plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload: dict[str, Any] = (
            plans[0].to_dict()
            if args.instance
            else {
                "model": model.name,
                "instances": [p.to_dict() for p in plans],
            }
        )
        print(json.dumps({**payload, **({"nxd_inference": target} if target else {})}, indent=2))
    else:
        if target:
            print(_format_target(target) + "\n")
        print(format_instance_plan(plans[0]) if args.instance else format_comparison(plans))
    return 1 if args.instance and plans[0].recommended_tp is None else 0


def _nxdi_release(args: argparse.Namespace, model: ModelSpec) -> dict[str, Any] | None:
    """With ``--platform`` or ``--nxdi-version``: the platform and the NxD Inference release, each with
    where it came from; refused (``UnsupportedReleaseError``) where the SDK matrix rules it out."""
    if not (args.platform or args.nxdi_version):
        return None
    platform, version, source = nxdi_target(args.platform, "--platform", args.nxdi_version, os.environ)
    version, source = library_release(version, platform, model.model_type, source)
    check_release(version, platform.name, model.model_type)
    return {
        "platform": platform.name,
        "platform_source": platform.source,
        "library_version": version,
        "library_version_source": source,
    }


def _format_target(target: dict[str, Any]) -> str:
    return (
        f"platform {target['platform'] or '-'} ({target['platform_source']}); NxD Inference "
        f"{target['library_version']} ({target['library_version_source']})"
    )


def _plans(model: ModelSpec, platform: str | None, kwargs: dict[str, Any]) -> tuple[InstancePlan, ...]:
    if platform is None:
        return plan_all_instances(model, **kwargs)
    instances = [spec for name, spec in INSTANCES.items() if name.split(".")[0] == platform]
    if not instances:
        raise ValueError(f"--platform {platform}: no {platform} instance is in the sizing catalog yet")
    return tuple(plan_instance(model, spec, **kwargs) for spec in instances)  # type: ignore[arg-type]


def format_instance_plan(plan: InstancePlan) -> str:
    """Two tables (the default strategy per tp, then KV per row under each GQA strategy) and the
    recommendation."""
    hbm = f"{plan.hbm_bytes_per_core / GIB:g} GiB"
    lines = [
        f"{plan.model} on {plan.instance} ({plan.cores} NeuronCores x {hbm}), {plan.dtype}, "
        f"n_positions={plan.n_positions}, batch_size={plan.batch_size}",
        f"budget per core: {_gib(plan.budget_bytes_per_core)} ({hbm} less {plan.headroom:.0%} headroom); "
        "token embedding stays on the host",
        "",
    ]
    # MoE models: the experts' share of the weights per core (every expert split over the tp ranks).
    moe = any(o.expert_weight_bytes_per_core for o in plan.options)
    header = (
        "tp",
        "replicas",
        "GQA (default)",
        "q/kv heads",
        "weights/core",
        *(("experts/core",) if moe else ()),
        "padding",
        "KV/row/core",
        "max rows",
        "fits",
    )
    rows = [
        (
            str(o.tp_degree),
            str(o.replicas),
            o.strategy,
            f"{o.query_heads_padded}/{o.kv_heads_effective}",
            _gib(o.weight_bytes_per_core),
            *((_gib(o.expert_weight_bytes_per_core),) if moe else ()),
            _mib(o.padding_bytes_per_core),
            _mib(o.kv_bytes_per_row_per_core),
            str(o.max_rows),
            "yes" if o.fits else "no",
        )
        for o in plan.options
    ]
    lines += _table(header, rows)
    lines += ["", "KV bytes per row per core by requested GQA strategy (-> what the library falls back to):"]
    header = ("tp", *(s.value for s in GQAStrategy))
    rows = [
        (
            str(o.tp_degree),
            *(
                _mib(c.kv_bytes_per_row_per_core)
                + ("" if c.effective == c.requested else f" -> {c.effective}")
                for c in o.strategies
            ),
        )
        for o in plan.options
    ]
    lines += _table(header, rows)
    fallbacks = [(o.tp_degree, o.fallback_reason) for o in plan.options if o.fallback_reason]
    lines += [f"  tp={tp}: {reason}" for tp, reason in fallbacks]
    verdict = "recommendation" if plan.recommended_tp is not None else "DOES NOT FIT"
    lines += ["", f"{verdict}: {plan.reason}"]
    return "\n".join(lines)


def format_comparison(plans: tuple[InstancePlan, ...]) -> str:
    """One line per instance: the recommended tp degree, or that the model does not fit."""
    first = plans[0]
    lines = [
        f"{first.model}, {first.dtype}, n_positions={first.n_positions}, batch_size={first.batch_size}, "
        f"headroom {first.headroom:.0%}",
        "",
    ]
    header = ("instance", "cores", "tp degrees", "recommended tp", "replicas", "weights/core", "max rows")
    rows = []
    for plan in plans:
        pick = plan.recommended
        rows.append(
            (
                plan.instance,
                str(plan.cores),
                ",".join(str(o.tp_degree) for o in plan.options),
                str(pick.tp_degree) if pick else "does not fit",
                str(pick.replicas) if pick else "-",
                _gib(pick.weight_bytes_per_core) if pick else "-",
                str(pick.max_rows) if pick else "-",
            )
        )
    lines += _table(header, rows)
    lines += [""] + [f"{p.instance}: {p.reason}" for p in plans]
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=False)]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"
