// The one translation unit the neuron_lmi:: ops' kernels build as (models/native.py). torch's headers
// are most of each file's compile time: parsed once here, not once per file, the library builds in
// about half the CPU time, on one core.
#include "packed_linear.cpp"
#include "decode_attention.cpp"
#include "token_draw.cpp"
#include "lora_delta.cpp"
