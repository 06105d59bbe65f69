"""``neuron-lmi deploy``: SageMaker upload, create, update, delete, autoscale and invoke.

The actions live in :mod:`neuron_lmi.deploy.sagemaker.cli`; boto3 is imported only when one runs.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from neuron_lmi.deploy.sagemaker import cli  # the actions' modules: loaded when deploy is asked for

    parser = subparsers.add_parser(
        "deploy",
        help="SageMaker endpoints: upload, create, update, delete, autoscale, invoke",
        description=cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_actions(parser)
    return parser
