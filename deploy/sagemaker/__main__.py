"""``python -m deploy.sagemaker``: upload, create and scale a neuron-lmi SageMaker endpoint, and call it.

Typical flow (uncompressed prefix, the faster start for large weights)::

    neuron-lmi package --model ./Mistral-7B --compiled ./neffs --option tensor_parallel_degree=8 --out pkg/
    python -m deploy.sagemaker upload --path pkg/ --s3 s3://my-bucket/mistral/
    python -m deploy.sagemaker deploy --name mistral --image <ecr image> --role <role arn> \\
        --model-data s3://my-bucket/mistral/ --instance-type ml.inf2.24xlarge --autoscale 1:4:60
    python -m deploy.sagemaker invoke-stream --endpoint mistral --prompt "Hello" --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deploy.sagemaker.invoke import generate
from deploy.sagemaker.resources import (
    AutoscalingSpec,
    EndpointConfigSpec,
    InferenceComponentSpec,
    ModelSpec,
    create_endpoint,
    create_endpoint_config,
    create_inference_component,
    create_model,
    enable_autoscaling,
)
from deploy.sagemaker.storage import upload_archive, upload_directory


def _client(args: argparse.Namespace, service: str, **kwargs: Any) -> Any:
    import boto3

    session = boto3.Session(region_name=args.region, profile_name=args.profile)
    return session.client(service, **kwargs)


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def _autoscale(text: str) -> tuple[int, int, float]:
    try:
        low, high, target = text.split(":")
        return int(low), int(high), float(target)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX:TARGET_INVOCATIONS, got {text!r}") from None


def _endpoint_config(args: argparse.Namespace, name: str, model: str | None) -> EndpointConfigSpec:
    return EndpointConfigSpec(
        name=name,
        model_name=None if args.inference_components else model,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        volume_size_gb=args.volume_size or None,
        model_data_download_timeout_s=args.download_timeout,
        startup_health_check_timeout_s=args.startup_timeout,
        inference_components=args.inference_components,
        role_arn=args.role,
    )


def cmd_upload(args: argparse.Namespace) -> int:
    s3 = _client(args, "s3", endpoint_url=args.endpoint_url)
    path = Path(args.path)
    uri = upload_directory(s3, path, args.s3) if path.is_dir() else upload_archive(s3, path, args.s3)
    print(uri)
    return 0


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(args.name, args.image, args.role, args.model_data, _env(args.env))


def _component_spec(args: argparse.Namespace, name: str, endpoint: str, model: str) -> InferenceComponentSpec:
    return InferenceComponentSpec(
        name, endpoint, model, copies=args.copies, accelerators=args.accelerators,
        min_memory_mb=args.memory_mb, model_data_download_timeout_s=args.download_timeout,
        startup_health_check_timeout_s=args.startup_timeout,
    )  # fmt: skip


def _scaling_spec(endpoint: str, component: str | None, bounds: tuple[int, int, float]) -> AutoscalingSpec:
    low, high, target = bounds
    return AutoscalingSpec(endpoint, inference_component=component, min_capacity=low,
                           max_capacity=high, target_invocations=target)  # fmt: skip


def cmd_deploy(args: argparse.Namespace) -> int:
    """Model, endpoint config, endpoint, optional inference component, optional autoscaling."""
    sm = _client(args, "sagemaker")
    print(create_model(sm, _model_spec(args)))
    print(create_endpoint_config(sm, _endpoint_config(args, args.name, args.name)))
    wait = args.wait or args.inference_components or args.autoscale is not None
    print(create_endpoint(sm, args.name, args.name, wait=wait))
    component = args.name if args.inference_components else None
    if component is not None:
        spec = _component_spec(args, component, args.name, args.name)
        print(create_inference_component(sm, spec, wait=args.autoscale is not None))
    if args.autoscale is not None:
        scaling = _scaling_spec(args.name, component, args.autoscale)
        print(enable_autoscaling(_client(args, "application-autoscaling"), scaling))
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    """One resource at a time: create-model, create-endpoint-config, create-endpoint, ..."""
    if args.command == "autoscale":
        scaling = _scaling_spec(args.endpoint, args.inference_component, args.autoscale)
        print(enable_autoscaling(_client(args, "application-autoscaling"), scaling))
        return 0
    sm = _client(args, "sagemaker")
    if args.command == "create-model":
        print(create_model(sm, _model_spec(args)))
    elif args.command == "create-endpoint-config":
        print(create_endpoint_config(sm, _endpoint_config(args, args.name, args.model)))
    elif args.command == "create-endpoint":
        print(create_endpoint(sm, args.name, args.config, wait=args.wait))
    else:
        spec = _component_spec(args, args.name, args.endpoint, args.model)
        print(create_inference_component(sm, spec, wait=args.wait))
    return 0


def cmd_invoke(args: argparse.Namespace) -> int:
    runtime = _client(args, "sagemaker-runtime")
    params: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.temperature is not None:
        params.update(temperature=args.temperature, do_sample=args.temperature > 0)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(
        runtime, args.endpoint, args.prompt, params, stream=args.stream, max_rounds=args.max_rounds,
        component=args.inference_component, on_text=show,
    )  # fmt: skip
    print(f"\n[finish_reason={result.finish_reason} tokens={result.generated_tokens} calls={result.rounds}]")
    return 0


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance-type", default="ml.inf2.48xlarge")
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument("--volume-size", type=int, default=256, help="GB of EBS (0: leave out)")
    parser.add_argument("--download-timeout", type=int, default=1800, help="ModelDataDownloadTimeout, s")
    parser.add_argument("--startup-timeout", type=int, default=1800, help="startup health check timeout, s")
    parser.add_argument("--inference-components", action="store_true", help="host the model as a component")
    parser.add_argument("--copies", type=int, default=1, help="inference component copies")
    parser.add_argument("--accelerators", type=int, default=1, help="accelerator devices per copy")
    parser.add_argument("--memory-mb", type=int, default=16384, help="host memory per copy")


def _add_step_parsers(sub: Any) -> None:
    model = sub.add_parser("create-model", help="CreateModel: image, model data, environment")
    model.add_argument("--name", required=True)
    model.add_argument("--image", required=True)
    model.add_argument("--role", required=True)
    model.add_argument("--model-data", help="s3://.../model.tar.gz or an s3://.../prefix/")
    model.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")

    config = sub.add_parser("create-endpoint-config", help="CreateEndpointConfig: one production variant")
    config.add_argument("--name", required=True)
    config.add_argument("--model", help="model name (not with --inference-components)")
    config.add_argument("--role", help="execution role (needed with --inference-components)")
    _add_endpoint_options(config)

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
    scale.add_argument("--autoscale", required=True, type=_autoscale, metavar="MIN:MAX:TARGET")
    for step in (model, config, endpoint, component, scale):
        step.set_defaults(func=cmd_step)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.sagemaker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--region")
    parser.add_argument("--profile")
    sub = parser.add_subparsers(dest="command", required=True)

    upload = sub.add_parser("upload", help="upload model.tar.gz, or a folder as an uncompressed prefix")
    upload.add_argument("--path", required=True, help="model.tar.gz or a packaged folder")
    upload.add_argument("--s3", required=True, help="s3://bucket/key or s3://bucket/prefix/")
    upload.add_argument("--endpoint-url", help="S3-compatible endpoint (testing)")
    upload.set_defaults(func=cmd_upload)

    deploy = sub.add_parser("deploy", help="create model, endpoint config, endpoint (+ component, scaling)")
    deploy.add_argument("--name", required=True, help="name for the model, config, endpoint and component")
    deploy.add_argument("--image", required=True, help="container image URI (ECR)")
    deploy.add_argument("--role", required=True, help="SageMaker execution role ARN")
    deploy.add_argument("--model-data", help="s3://.../model.tar.gz or an s3://.../prefix/")
    deploy.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    deploy.add_argument("--wait", action="store_true", help="wait until the endpoint is InService")
    deploy.add_argument("--autoscale", type=_autoscale, metavar="MIN:MAX:TARGET", help="invocations/min")
    _add_endpoint_options(deploy)
    deploy.set_defaults(func=cmd_deploy)

    _add_step_parsers(sub)
    for name, stream in (("invoke", False), ("invoke-stream", True)):
        call = sub.add_parser(name, help=f"generate through {'streaming ' if stream else ''}invocations")
        call.add_argument("--endpoint", required=True)
        call.add_argument("--inference-component")
        call.add_argument("--prompt", required=True)
        call.add_argument("--max-new-tokens", type=int, default=256)
        call.add_argument("--temperature", type=float)
        call.add_argument("--max-rounds", type=int, default=4, help="continue while finish_reason=length")
        call.set_defaults(func=cmd_invoke, stream=stream)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
