"""``neuron-lmi deploy``: upload, create, update, scale and delete a neuron-lmi SageMaker endpoint,
and call it.

Typical flow (uncompressed prefix, the faster start for large weights)::

    neuron-lmi package --model ./Mistral-7B --compiled ./neffs --option tensor_parallel_degree=8 --out pkg/
    neuron-lmi deploy upload --path pkg/ --s3 s3://my-bucket/mistral-v1/
    neuron-lmi deploy create --name mistral --image <ecr image> --role <role arn> \\
        --model-data s3://my-bucket/mistral-v1/ --instance-type ml.inf2.24xlarge \\
        --tensor-parallel-degree 8 --autoscale 1:4:60
    neuron-lmi deploy invoke-stream --endpoint mistral --prompt "Hello" --max-new-tokens 256
    neuron-lmi deploy update --name mistral --image <ecr image> --role <role arn> \\
        --model-data s3://my-bucket/mistral-v2/ --instance-type ml.inf2.24xlarge --tensor-parallel-degree 8
    neuron-lmi deploy delete --name mistral

Scale to zero (inference components only): ``create --inference-components --autoscale 0:4:5
--scale-metric concurrency`` sets MinInstanceCount=0 and adds the NoCapacityInvocationFailures alarm.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from neuron_lmi.deploy.sagemaker import commands


def _autoscale(text: str) -> tuple[int, int, float]:
    try:
        low, high, target = text.split(":")
        return int(low), int(high), float(target)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX:TARGET, got {text!r}") from None


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance-type", default="ml.inf2.48xlarge")
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument(
        "--volume-size",
        type=int,
        help="GB of EBS (default 256 where the family accepts "
        "it; left out for NVMe families such as ml.g5, ml.trn1, ml.g4dn; 0: leave out)",
    )
    parser.add_argument("--download-timeout", type=int, default=1800, help="ModelDataDownloadTimeout, s")
    parser.add_argument("--startup-timeout", type=int, default=1800, help="startup health check timeout, s")
    parser.add_argument(
        "--tensor-parallel-degree",
        help="ranks per copy (default: OPTION_TENSOR_PARALLEL_"
        "DEGREE from --env); sizes --accelerators and checks it",
    )
    group = parser.add_argument_group("inference components")
    group.add_argument("--inference-components", action="store_true", help="host the model as a component")
    group.add_argument("--copies", type=int, default=1, help="inference component copies")
    group.add_argument(
        "--accelerators",
        type=int,
        help="devices per copy (default: from the tensor "
        "parallel degree; a Neuron device holds 2 NeuronCores on inf2/trn1)",
    )
    group.add_argument("--memory-mb", type=int, default=16384, help="host memory per copy")
    group.add_argument(
        "--min-instances", type=int, help="managed instance scaling minimum (0: scale to zero)"
    )
    group.add_argument("--max-instances", type=int, help="managed instance scaling maximum")


def _add_scaling_options(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument(
        "--autoscale",
        type=_autoscale,
        required=required,
        metavar="MIN:MAX:TARGET",
        help="target tracking on instances (or component copies); MIN 0 needs components",
    )
    parser.add_argument(
        "--scale-metric",
        choices=("invocations", "concurrency"),
        default="invocations",
        help="TARGET is invocations per minute, or concurrent requests (high resolution)",
    )


def _add_model_options(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--image", required=required, help="container image URI (ECR)")
    parser.add_argument("--role", required=required, help="SageMaker execution role ARN")
    parser.add_argument("--model-data", help="s3://.../model.tar.gz or an s3://.../prefix/")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")


def _add_lifecycle_parsers(sub: Any) -> None:
    create = sub.add_parser(
        "create", aliases=["deploy"], help="model, endpoint config, endpoint (+ component, autoscaling)"
    )
    create.add_argument("--name", required=True, help="name for the model, config, endpoint and component")
    _add_model_options(create, required=True)
    create.add_argument("--wait", action="store_true", help="wait until the endpoint is InService")
    _add_endpoint_options(create)
    _add_scaling_options(create)
    create.set_defaults(func=commands.cmd_create)

    update = sub.add_parser("update", help="new model/config version (or component) on a running endpoint")
    update.add_argument("--name", required=True)
    update.add_argument("--version", help="suffix of the new model and config names (default: a timestamp)")
    _add_model_options(update, required=False)
    update.add_argument("--wait", action="store_true")
    _add_endpoint_options(update)
    _add_scaling_options(update)
    update.set_defaults(func=commands.cmd_update)

    delete = sub.add_parser("delete", help="components, scaling, alarms, endpoint, config and models")
    delete.add_argument("--name", required=True, help="the endpoint")
    delete.add_argument("--keep-model", action="store_true", help="keep the SageMaker models")
    delete.set_defaults(func=commands.cmd_delete)


def _add_step_parsers(sub: Any) -> None:
    model = sub.add_parser("create-model", help="CreateModel: image, model data, environment")
    model.add_argument("--name", required=True)
    _add_model_options(model, required=True)

    config = sub.add_parser("create-endpoint-config", help="CreateEndpointConfig: one production variant")
    config.add_argument("--name", required=True)
    config.add_argument("--model", help="model name (not with --inference-components)")
    config.add_argument("--role", help="execution role (needed with --inference-components)")
    _add_endpoint_options(config)
    config.set_defaults(autoscale=None, env=[])

    endpoint = sub.add_parser("create-endpoint", help="CreateEndpoint from an endpoint config")
    endpoint.add_argument("--name", required=True)
    endpoint.add_argument("--config", required=True)
    endpoint.add_argument("--wait", action="store_true")

    component = sub.add_parser("create-inference-component", help="CreateInferenceComponent")
    component.add_argument("--name", required=True)
    component.add_argument("--endpoint", required=True)
    component.add_argument("--model", required=True)
    component.add_argument("--wait", action="store_true")
    _add_endpoint_options(component)

    scale = sub.add_parser("autoscale", help="target tracking on a variant or an inference component")
    scale.add_argument("--endpoint", required=True)
    scale.add_argument("--inference-component", help="scale this component's copies instead")
    _add_scaling_options(scale, required=True)
    for step in (model, config, endpoint, component, scale):
        step.set_defaults(func=commands.cmd_step)


def add_actions(parser: argparse.ArgumentParser) -> None:
    """Every ``deploy`` action, on ``parser`` (``neuron-lmi deploy`` or ``python -m deploy.sagemaker``)."""
    parser.add_argument("--region")
    parser.add_argument("--profile")
    sub = parser.add_subparsers(dest="action", required=True)
    upload = sub.add_parser("upload", help="upload model.tar.gz, or a folder to an empty S3 prefix")
    upload.add_argument("--path", required=True, help="model.tar.gz or a packaged folder")
    upload.add_argument("--s3", required=True, help="s3://bucket/key or s3://bucket/prefix/ (empty)")
    upload.add_argument("--endpoint-url", help="S3-compatible endpoint (testing)")
    upload.set_defaults(func=commands.cmd_upload)
    _add_lifecycle_parsers(sub)
    _add_step_parsers(sub)
    for name, stream in (("invoke", False), ("invoke-stream", True)):
        call = sub.add_parser(name, help=f"generate through {'streaming ' if stream else ''}invocations")
        call.add_argument("--endpoint", required=True)
        call.add_argument("--inference-component")
        call.add_argument("--prompt", required=True)
        call.add_argument("--max-new-tokens", type=int, default=256)
        call.add_argument("--temperature", type=float)
        call.add_argument("--max-rounds", type=int, default=4, help="continue while finish_reason=length")
        call.set_defaults(func=commands.cmd_invoke, stream=stream)


def build_parser(prog: str = "neuron-lmi deploy") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_actions(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "neuron-lmi deploy") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
