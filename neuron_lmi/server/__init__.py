"""The HTTP server: LMI/SageMaker, TGI and OpenAI APIs over one ``Engine`` (see ``create_app``)."""

from neuron_lmi.server.app import create_app
from neuron_lmi.server.options import AppOptions

__all__ = ["AppOptions", "create_app"]
