"""neuron-lmi: compile and serve LLMs on NeuronCores, vLLM on CUDA, and a CPU reference engine anywhere."""

__version__ = "0.1.0"
