"""Which requests a runner's device sampler can draw for, and what it is told for each line.

A runner with ``RunnerCapabilities.device_sampling`` draws every line's token on the device from
that line's (top_k, top_p, temperature); NxD Inference's sampler takes exactly those three per row
(``sampling_params`` ``[batch, 3]``) and nothing else. A request that needs more is sampled on the
host, by ``engine.sampling.sample``, from the logits the runner returns beside the tokens; a runner
that returns no logits cannot serve it, and the request is refused naming the field::

    greedy, nothing else asked        device: top_k=1 (its most likely token, as argmax)
    temperature / top_k / top_p       device: (top_k or the device's largest, top_p, temperature)
    log-probabilities, top tokens,    host, from the logits: the device's draw is not used
    penalties, logit_bias, grammar,
    min_tokens; sampled with a seed,
    min_p, or top_k past the device's

A seeded request goes to the host because the device draws from its own generator, not the
request's (``torch.Generator``): only the host makes a seed reproducible.
"""

from __future__ import annotations

from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.runners.base import GREEDY_LINE, DeviceSampling, LineSampling


def host_field(params: SamplingParams, device: DeviceSampling) -> str | None:
    """The first request field the device sampler cannot honour (the host must sample), or None."""
    if params.logprobs:
        return "logprobs"
    if params.top_n_tokens:
        return "top_n_tokens"
    if params.repetition_penalty != 1.0:
        return "repetition_penalty"
    if params.presence_penalty:
        return "presence_penalty"
    if params.frequency_penalty:
        return "frequency_penalty"
    if params.logit_bias:
        return "logit_bias"
    if params.grammar is not None:
        return "grammar"
    if params.min_tokens:
        return "min_tokens"
    if params.greedy:
        return None
    if not device.per_line:
        return "temperature"  # a greedy-only device sampler would turn a sampled request greedy
    if params.seed is not None:
        return "seed"
    if params.min_p > 0.0:
        return "min_p"
    if params.top_k > device.max_top_k:
        return "top_k"
    return None


def line_sampling(params: SamplingParams, device: DeviceSampling) -> LineSampling:
    """The device's sampling inputs for a request it can draw for (``host_field`` is None): greedy is
    top_k 1 at temperature 1 (a temperature of 0 would divide by zero); no top-k limit is the device's
    largest."""
    if params.greedy:
        return GREEDY_LINE
    top_k = params.top_k if 0 < params.top_k <= device.max_top_k else device.max_top_k
    return LineSampling(top_k, params.top_p, params.temperature)
