"""transformers-neuronx (Neuron SDK <= 2.25): its argument mapping (``args``), compile into the
compile cache (``compile``), runner over ``LlamaForSampling``/``MistralForSampling`` (``runner``) and
engine builder (``build``). The contract model CI drives it with is ``neuron_lmi.testing.tnx_contract``."""
