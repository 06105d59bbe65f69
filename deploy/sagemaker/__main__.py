"""``python -m deploy.sagemaker`` in a checkout: the same actions as ``neuron-lmi deploy``."""

import sys

from neuron_lmi.deploy.sagemaker.cli import main

sys.exit(main(prog="python -m deploy.sagemaker"))
