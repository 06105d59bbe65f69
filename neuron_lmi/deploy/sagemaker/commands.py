"""The actions behind ``neuron-lmi deploy``: each turns parsed flags into specs, checks every spec,
and only then makes its boto3 calls, so a bad flag never leaves a half-created deployment."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from neuron_lmi.config.keys import env_lookup
from neuron_lmi.deploy.sagemaker.instances import check_accelerators, default_volume_size, devices_needed
from neuron_lmi.deploy.sagemaker.invoke import generate
from neuron_lmi.deploy.sagemaker.resources import (
    EndpointConfigSpec,
    InferenceComponentSpec,
    ModelSpec,
    create_endpoint,
    create_endpoint_config,
    create_inference_component,
    create_model,
)
from neuron_lmi.deploy.sagemaker.scaling import (
    AutoscalingSpec,
    ScaleFromZeroSpec,
    check_instance_scaling,
    enable_autoscaling,
    enable_scale_from_zero,
    variant_resource,
)
from neuron_lmi.deploy.sagemaker.storage import upload_archive, upload_directory


def client(args: argparse.Namespace, service: str, **kwargs: Any) -> Any:
    import boto3

    session = boto3.Session(region_name=args.region, profile_name=args.profile)
    return session.client(service, **kwargs)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def _int_option(name: str, text: str | None) -> int | None:
    if text is None or text.strip().lower() == "max":
        return None  # "max": every visible core, whatever the copy gets
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None


def parallelism(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """``(tensor_parallel_degree, logical_nc_config)`` from the flag, else from the model's ``--env``
    read through neuron-lmi's own key table (``OPTION_TENSOR_PARALLEL_DEGREE``, ``SM_NUM_GPUS``, ...);
    None where unknown."""
    found, _ = env_lookup(parse_env(getattr(args, "env", [])))
    tp = args.tensor_parallel_degree or found.get("tensor_parallel_degree", ("", None))[1]
    lnc = found.get("logical_nc_config", ("", None))[1]
    return _int_option("tensor_parallel_degree", tp), _int_option("logical_nc_config", lnc)


def model_spec(args: argparse.Namespace, name: str) -> ModelSpec:
    if not args.image or not args.role:
        raise ValueError("a new model needs --image and --role")
    return ModelSpec(name, args.image, args.role, args.model_data, parse_env(args.env))


def endpoint_config(args: argparse.Namespace, name: str, model: str | None) -> EndpointConfigSpec:
    volume = args.volume_size if args.volume_size is not None else default_volume_size(args.instance_type)
    low = args.min_instances
    if low is None and args.inference_components and args.autoscale and args.autoscale[0] == 0:
        low = 0  # copies may reach zero: let the instances follow
    tp, lnc = parallelism(args)
    if tp is not None and not args.inference_components:
        check_accelerators(args.instance_type, tp, None, lnc)  # the whole instance serves one model
    return EndpointConfigSpec(
        name=name,
        model_name=None if args.inference_components else model,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        volume_size_gb=volume or None,
        model_data_download_timeout_s=args.download_timeout,
        startup_health_check_timeout_s=args.startup_timeout,
        inference_components=args.inference_components,
        role_arn=args.role,
        min_instances=low,
        max_instances=args.max_instances,
    )


def component_spec(args: argparse.Namespace, name: str, endpoint: str, model: str) -> InferenceComponentSpec:
    tp, lnc = parallelism(args)
    accelerators = args.accelerators
    if accelerators is None:
        accelerators = (devices_needed(args.instance_type, tp, lnc) if tp else None) or 1
    return InferenceComponentSpec(
        name,
        endpoint,
        model,
        copies=args.copies,
        accelerators=accelerators,
        min_memory_mb=args.memory_mb,
        model_data_download_timeout_s=args.download_timeout,
        startup_health_check_timeout_s=args.startup_timeout,
        instance_type=args.instance_type,
        tensor_parallel_degree=tp,
        logical_nc_config=lnc,
    )


def scaling_spec(args: argparse.Namespace, endpoint: str, component: str | None) -> AutoscalingSpec | None:
    if args.autoscale is None:
        return None
    low, high, target = args.autoscale
    return AutoscalingSpec(
        endpoint,
        inference_component=component,
        min_capacity=low,
        max_capacity=high,
        target_value=target,
        metric=args.scale_metric,
    )


def apply_scaling(args: argparse.Namespace, scaling: AutoscalingSpec) -> None:
    autoscaling = client(args, "application-autoscaling")
    print(enable_autoscaling(autoscaling, scaling))
    if scaling.scales_to_zero and scaling.inference_component:
        alarm = ScaleFromZeroSpec(scaling.inference_component)
        print(enable_scale_from_zero(autoscaling, client(args, "cloudwatch"), alarm))


Plan = tuple[EndpointConfigSpec, InferenceComponentSpec | None, AutoscalingSpec | None]


def _plan(args: argparse.Namespace, name: str, model: str) -> Plan:
    """The config, component and scaling specs of one deployment, all checked."""
    component = args.name if args.inference_components else None
    scaling = scaling_spec(args, args.name, component)
    config = endpoint_config(args, name, model)
    config.validate()
    if component is not None:
        check_instance_scaling(config.instance_range()[0], scaling)
    ic = component_spec(args, component, args.name, model) if component is not None else None
    if ic is not None:
        ic.validate()
    if scaling is not None:
        scaling.validate()
    return config, ic, scaling


def cmd_create(args: argparse.Namespace) -> int:
    """Model, endpoint config, endpoint, optional inference component, optional autoscaling."""
    model = model_spec(args, args.name)
    model.request()
    config, component, scaling = _plan(args, args.name, args.name)
    sm = client(args, "sagemaker")
    print(create_model(sm, model))
    print(create_endpoint_config(sm, config))
    wait = args.wait or component is not None or scaling is not None
    print(create_endpoint(sm, args.name, args.name, wait=wait))
    if component is not None:
        print(create_inference_component(sm, component, wait=args.wait or scaling is not None))
    if scaling is not None:
        apply_scaling(args, scaling)
    return 0


def _inherit(args: argparse.Namespace, current: Any) -> argparse.Namespace:
    """Check ``update``'s flags against the running deployment, and fill what they leave out from
    it: the execution role, and a component's devices per copy when no degree or count is given."""
    if args.inference_components != bool(current.components):
        hosted = ", ".join(current.components) or "none"
        raise ValueError(
            f"--inference-components={args.inference_components}, but {args.name} hosts: {hosted}"
        )
    if args.inference_components and args.name not in current.components:
        raise ValueError(f"{args.name} hosts {', '.join(current.components)}, not a component {args.name}")
    args = argparse.Namespace(**vars(args))
    if args.inference_components and not args.role:
        args.role = current.role
    if args.inference_components and args.accelerators is None and parallelism(args)[0] is None:
        resources = current.components[args.name].get("ComputeResourceRequirements", {})
        args.accelerators = resources.get("NumberOfAcceleratorDevicesRequired")
    return args


def cmd_update(args: argparse.Namespace) -> int:
    """A new model version when the image, data or environment changed; a new endpoint config and
    UpdateEndpoint for a plain endpoint; UpdateInferenceComponent for a component (and UpdateEndpoint
    only when its instance settings changed)."""
    from neuron_lmi.deploy.sagemaker import lifecycle

    sm = client(args, "sagemaker")
    current = lifecycle.describe_deployment(sm, args.name)
    if current.endpoint is None:
        raise ValueError(f"endpoint {args.name!r} not found: create it first")
    args = _inherit(args, current)
    version = args.version or time.strftime("%Y%m%d-%H%M%S")
    changes_model = bool(args.image or args.model_data or args.env)
    new_model = model_spec(args, lifecycle.versioned(args.name, version)) if changes_model else None
    if new_model is not None:
        new_model.request()
    hosted_model = current.components.get(args.name, {}).get("ModelName")
    model = new_model.name if new_model else hosted_model or current.models[0]
    config, component, scaling = _plan(args, lifecycle.versioned(args.name, version), model)
    if new_model is not None:
        print(create_model(sm, new_model))
    changed = lifecycle.variant_changed(current.variant, config.request()["ProductionVariants"][0])
    if component is None or changed:
        if component is None and current.variant.get("InstanceType") != config.instance_type:
            _deregister_variant(args, args.name, current.variant.get("VariantName", "AllTraffic"))
        wait = args.wait or component is not None or scaling is not None
        print(lifecycle.update_endpoint(sm, args.name, config, wait=wait))
    if component is not None:
        print(lifecycle.update_inference_component(sm, component, wait=args.wait or scaling is not None))
    if scaling is not None:
        apply_scaling(args, scaling)
    return 0


def _deregister_variant(args: argparse.Namespace, endpoint: str, variant: str) -> None:
    """SageMaker refuses to change the instance type of a variant that is a scaling target."""
    from neuron_lmi.deploy.sagemaker.lifecycle import tolerate_missing

    resource_id, dimension = variant_resource(endpoint, variant)
    autoscaling = client(args, "application-autoscaling")
    found = tolerate_missing(
        autoscaling.deregister_scalable_target,
        ServiceNamespace="sagemaker",
        ResourceId=resource_id,
        ScalableDimension=dimension,
    )
    if found is not None:
        note = "the instance type changes; pass --autoscale to scale it again"
        print(f"deregistered {resource_id} from autoscaling: {note}", file=sys.stderr)


def cmd_delete(args: argparse.Namespace) -> int:
    from neuron_lmi.deploy.sagemaker.lifecycle import delete_deployment

    sm, autoscaling, cloudwatch = (
        client(args, s) for s in ("sagemaker", "application-autoscaling", "cloudwatch")
    )
    removed = delete_deployment(sm, autoscaling, cloudwatch, args.name, keep_models=args.keep_model)
    for what in removed:
        print(f"deleted {what}")
    if not removed:
        print(f"nothing named {args.name} found", file=sys.stderr)
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    s3 = client(args, "s3", endpoint_url=args.endpoint_url)
    path = Path(args.path)
    print(upload_directory(s3, path, args.s3) if path.is_dir() else upload_archive(s3, path, args.s3))
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    """One resource at a time: create-model, create-endpoint-config, create-endpoint, ..."""
    if args.action == "autoscale":
        scaling = scaling_spec(args, args.endpoint, args.inference_component)
        if scaling is not None:
            apply_scaling(args, scaling)
        return 0
    sm = client(args, "sagemaker")
    if args.action == "create-model":
        print(create_model(sm, model_spec(args, args.name)))
    elif args.action == "create-endpoint-config":
        print(create_endpoint_config(sm, endpoint_config(args, args.name, args.model)))
    elif args.action == "create-endpoint":
        print(create_endpoint(sm, args.name, args.config, wait=args.wait))
    else:
        spec = component_spec(args, args.name, args.endpoint, args.model)
        print(create_inference_component(sm, spec, wait=args.wait))
    return 0


def cmd_invoke(args: argparse.Namespace) -> int:
    runtime = client(args, "sagemaker-runtime")
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
