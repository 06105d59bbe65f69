"""vLLM's extensions to the OpenAI request bodies (vLLM 0.32's ``ChatCompletionRequest`` and
``CompletionRequest``), so clients built against vLLM (guidellm, lm-evaluation-harness, LiteLLM's
``hosted_vllm/``) work unchanged. docs/openai-extensions.md lists what each one does here.

Three kinds of field:

- honoured: the sampler's (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
  ``ignore_eos``, declared with the OpenAI fields), the text's (``include_stop_str_in_output``,
  ``skip_special_tokens``, ``stop_token_ids``), the prompt's (``truncate_prompt_tokens``,
  ``truncation_side``, chat's ``add_generation_prompt``, ``continue_final_message``,
  ``chat_template_kwargs``, ``documents``), ``structured_outputs`` and chat's ``include_reasoning``;
- accepted with no effect on this engine: scheduling and bookkeeping hints (``priority``,
  ``request_id``, ``cache_salt``, ``kv_transfer_params``...), fields about features this engine has
  not got (multimodal inputs, a thinking budget) and output extras (``return_token_ids``...);
- refused by name when they ask for something this engine cannot do and ignoring it would change
  the answer (``use_beam_search: true``, ``allowed_token_ids``, ``bad_words``, ``prompt_embeds``, a
  per-request ``chat_template``, which vLLM also refuses unless its operator trusts them).

Unknown fields stay refused by name (``RequestModel``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, JsonValue

from neuron_lmi.server.errors import invalid
from neuron_lmi.server.schema_types import RequestModel, TokenId

INT64 = 2**63
# Arguments of apply_chat_template that chat_template_kwargs must not replace (the server sets them).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "return_dict", "chat_template"}
)


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON Schema.")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, description="The output is one of these strings.")
    grammar: str | None = Field(default=None, description="A context-free grammar (Lark or GBNF).")
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(default=False, description="JSON without free whitespace.")
    disable_additional_properties: bool = Field(
        default=False, description="Objects without additionalProperties get false."
    )
    whitespace_pattern: str | None = Field(default=None, description="A regex for JSON's whitespace.")
    structural_tag: str | None = Field(default=None, description="Refused: not supported here.")


class VllmFields(RequestModel):
    """The fields vLLM adds to both chat and completions requests."""

    use_beam_search: bool = Field(default=False, description="Refused when true: no beam search here.")
    length_penalty: float = Field(default=1.0, description="Beam search only: no effect.")
    watermarking: bool | None = Field(default=None, description="Refused when true.")
    stop_token_ids: list[TokenId] | None = Field(
        default=None, description="Token ids that end the output as EOS does (not printed)."
    )
    include_stop_str_in_output: bool = Field(
        default=False, description="The text ends with the stop sequence that ended it."
    )
    skip_special_tokens: bool = Field(default=True, description="false: special tokens are printed.")
    spaces_between_special_tokens: bool = Field(default=True, description="No effect.")
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, lt=INT64, description="Keep this many prompt tokens (-1: the model's limit)."
    )
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="left (default) keeps the last tokens, right the first."
    )
    prompt_logprobs: int | None = Field(
        default=None, description="No effect (on /v1/completions echo with logprobs scores the prompt)."
    )
    logprob_token_ids: list[TokenId] | None = Field(default=None, description="Refused: not supported.")
    allowed_token_ids: list[TokenId] | None = Field(default=None, description="Refused: not supported.")
    bad_words: list[str] | None = Field(default=None, description="Refused when not empty.")
    add_special_tokens: bool | None = Field(default=None, description="No effect.")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="Constrain the output (vLLM's form of response_format)."
    )
    priority: int = Field(default=0, ge=-INT64, lt=INT64, description="No effect: one queue, in order.")
    request_id: str | None = Field(default=None, description="No effect.")
    session_id: str | None = Field(default=None, description="No effect.")
    return_tokens_as_token_ids: bool | None = Field(default=None, description="No effect.")
    return_token_ids: bool | None = Field(default=None, description="No effect.")
    routed_experts_prompt_start: int = Field(default=0, ge=0, description="No effect.")
    return_token_offsets: bool | None = Field(default=None, description="No effect.")
    mm_payload: Literal["tensors", "none"] = Field(default="tensors", description="No effect.")
    return_mm_kwargs: bool | None = Field(default=None, description="No effect.")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024, description="No effect.")
    kv_transfer_params: dict[str, JsonValue] | None = Field(default=None, description="No effect.")
    ec_transfer_params: dict[str, JsonValue] | None = Field(default=None, description="No effect.")
    vllm_xargs: dict[str, JsonValue] | None = Field(default=None, description="No effect.")
    repetition_detection: dict[str, int] | None = Field(default=None, description="No effect.")
    stream_interval: int | None = Field(default=None, ge=1, description="No effect: every token is sent.")
    thinking_token_budget: int | None = Field(
        default=None, description="No effect: thinking is not budgeted."
    )
    # OpenAI fields that change nothing a self-hosted server does.
    store: bool | None = Field(default=None, description="No effect.")
    metadata: dict[str, str] | None = Field(default=None, description="No effect.")
    service_tier: str | None = Field(default=None, description="No effect.")
    prompt_cache_key: str | None = Field(default=None, description="No effect.")
    safety_identifier: str | None = Field(default=None, description="No effect.")

    def refused(self) -> dict[str, bool]:
        """Field name -> whether it asks for something this engine cannot do."""
        return {
            "use_beam_search": self.use_beam_search,
            "watermarking": bool(self.watermarking),
            "logprob_token_ids": self.logprob_token_ids is not None,
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
        }


class VllmChatFields(RequestModel):
    """The fields vLLM adds to chat requests only."""

    reasoning_effort: str | None = Field(
        default=None, description="No effect: the chat template decides whether a model thinks."
    )
    include_reasoning: bool = Field(
        default=True,
        description="false: the thinking (option.reasoning_parser) is left out of message.reasoning.",
    )
    echo: bool = Field(default=False, description="No effect.")
    add_generation_prompt: bool = Field(
        default=True, description="Whether the chat template opens the assistant's turn."
    )
    continue_final_message: bool = Field(
        default=False, description="The last (assistant) message is continued, left open."
    )
    documents: list[dict[str, str]] | None = Field(
        default=None, description="Passed to the chat template (templates with RAG support read it)."
    )
    chat_template: str | None = Field(default=None, description="Refused: the model's template is used.")
    chat_template_kwargs: dict[str, JsonValue] | None = Field(
        default=None, description="Extra variables for the chat template."
    )
    media_io_kwargs: dict[str, JsonValue] | None = Field(default=None, description="No effect.")
    mm_processor_kwargs: dict[str, JsonValue] | None = Field(default=None, description="No effect.")
    return_prompt_text: bool | None = Field(default=None, description="No effect.")

    def refused(self) -> dict[str, bool]:
        return {"chat_template": self.chat_template is not None}

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template`` beyond the messages and tools."""
        if self.continue_final_message and self.add_generation_prompt:
            message = "continue_final_message and add_generation_prompt cannot both be true"
            raise invalid("openai", message, "continue_final_message")
        given = self.chat_template_kwargs or {}
        kwargs: dict[str, Any] = {k: v for k, v in given.items() if k not in RESERVED_TEMPLATE_KWARGS}
        kwargs["add_generation_prompt"] = self.add_generation_prompt
        kwargs["continue_final_message"] = self.continue_final_message
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return kwargs


class VllmCompletionFields(RequestModel):
    """The fields vLLM adds to completions requests only."""

    prompt_embeds: str | list[str] | None = Field(default=None, description="Refused: not supported.")

    def refused(self) -> dict[str, bool]:
        return {"prompt_embeds": self.prompt_embeds is not None}


def truncated(ids: list[int], keep: int | None, side: str | None, limit: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt cut to ``keep`` tokens (-1: the model's
    ``limit``), from the left unless ``side`` is right; None leaves it whole."""
    if keep is None:
        return ids
    keep = limit if keep == -1 else keep
    if keep >= len(ids):
        return ids
    if keep == 0:
        raise invalid("openai", "truncate_prompt_tokens=0 leaves no prompt", "truncate_prompt_tokens")
    return ids[:keep] if side == "right" else ids[-keep:]
