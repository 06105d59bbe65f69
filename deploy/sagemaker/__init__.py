"""Moved to :mod:`neuron_lmi.deploy.sagemaker` (``neuron-lmi deploy``); re-exported for checkouts."""

from neuron_lmi.deploy.sagemaker import *  # noqa: F403
from neuron_lmi.deploy.sagemaker import __all__  # noqa: F401
