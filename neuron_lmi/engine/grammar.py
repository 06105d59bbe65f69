"""Grammar-constrained decoding with llguidance: compile once per spec, mask per step, advance per token.

    GrammarSpec (types.py) --GrammarCompiler.state(spec)--> GrammarState (a copy of a cached matcher)
    every step:   allowed_tokens(states, vocab)  -> bool [G, vocab], one batched llguidance call
    every token:  state.accept(token)

A matcher that finished (or failed) allows only EOS, so a constrained request ends right after its
output is complete.

JSON allows whitespace between its tokens, as vLLM configures llguidance by default
(``whitespace_flexible``, unless ``disable_any_whitespace``) and as its default xgrammar backend
does (``any_whitespace``): a model writes JSON with the newlines and indentation it learned.
Forbidding them made models that format JSON pick worse tokens where a newline belonged (runs to
``max_tokens`` repeating an array item, where vLLM's output ended). One difference, on purpose: a
gap holds at most one line break and ``MAX_INDENT`` spaces or tabs (``WHITESPACE``), enough for
any pretty-printed JSON, where vLLM's grammars take any run of whitespace, on which a model can
spin until ``max_tokens`` (xgrammar later added ``max_whitespace_cnt`` for that). A schema can
still set its own (``"x-guidance": {"whitespace_pattern": ...}`` or ``{"whitespace_flexible":
false}``; vLLM's ``structured_outputs`` fields ``whitespace_pattern``, ``disable_any_whitespace``).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from neuron_lmi.engine.types import GrammarKind, GrammarSpec, InvalidRequestError

log = logging.getLogger(__name__)

# llguidance's JSON compiler options: whitespace allowed between tokens, bounded per gap.
MAX_INDENT = 24
WHITESPACE = rf"(\r?\n)?[\x20\x09]{{0,{MAX_INDENT}}}"
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE}


def with_json_options(schema: Any) -> Any:
    """``schema`` with ``JSON_OPTIONS`` under ``x-guidance``, unless it sets its own whitespace (the
    options llguidance takes as defaults would override a schema's ``whitespace_flexible``)."""
    if not isinstance(schema, dict):
        return schema
    own = schema.get("x-guidance") or {}
    if "whitespace_flexible" in own or "whitespace_pattern" in own:
        return schema
    return {**schema, "x-guidance": {**JSON_OPTIONS, **own}}


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec``, unchecked (``check_grammar`` checks it)."""
    try:
        if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
            schema = spec.schema()  # {"type": "object"} for JSON_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(with_json_options(schema)))
        if spec.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        return llguidance.grammar_from("grammar", spec.value)  # GBNF or Lark
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{spec.field}: invalid {spec.kind.value}: {exc}", spec.field) from None


@functools.lru_cache(maxsize=256)
def check_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec``; ``InvalidRequestError`` (the field the grammar came
    from) with the grammar engine's reason when it cannot be compiled. Needs no tokenizer, so
    admission refuses a bad schema before anything is queued."""
    text = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, None)
    if is_error:
        reason = messages[0].strip() if messages else "unknown error"
        raise InvalidRequestError(
            f"{spec.field}: the {spec.kind.value} cannot be compiled: {reason}", spec.field
        )
    return text


class GrammarState:
    """One request's position in its grammar. Invariant: advanced only by ``accept``, once per
    generated token, in order; once ``done`` it allows only EOS."""

    __slots__ = ("executor", "matcher", "n_vocab")

    def __init__(self, matcher: Any, executor: Any, n_vocab: int) -> None:
        self.matcher = matcher
        self.executor = executor
        self.n_vocab = n_vocab  # the grammar's vocabulary (>= the model's logits width)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar refused it (the state then allows only EOS)."""
        if self.matcher.is_stopped():
            return True
        ok = bool(self.matcher.consume_token(int(token)))
        if not ok:
            log.warning("grammar refused token %d: %s", token, self.matcher.get_error()[:500])
        return ok


def tokenizer_json(tokenizer: Any) -> str:
    """A fast tokenizer's ``tokenizer.json`` as llguidance should read it (``llguidance.hf`` does the
    same, less the fix): a byte-level BPE whose decoder is a Sequence ending in ByteLevel (what
    transformers' GGUF conversion writes for SmolLM2) gets a plain ByteLevel decoder, or llguidance
    would read its tokens literally ("Ġ" instead of a space) and its masks would be wrong."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError("structured output needs a fast (Rust) tokenizer", "grammar")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    decoder = data.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    byte_level = [d for d in steps if d.get("type") == "ByteLevel"]
    if byte_level and (data.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
        data["decoder"] = byte_level[-1]
    return json.dumps(data)


class GrammarCompiler:
    """Compiles ``GrammarSpec``s against one tokenizer and caches the results (LRU, by spec).

    Invariant: a cached matcher is never advanced; each request gets its own ``deep_copy``.
    The tokenizer adapter (about a second to build) is made on the first constrained request.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], max_cached: int = 256
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.max_cached = max_cached
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self.compiled = 0  # cache misses, for tests and metrics

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            n_vocab = max(self.vocab_size, len(self.tokenizer))
            eos = self.eos_token_ids or getattr(self.tokenizer, "eos_token_id", None)
            self._ll_tokenizer = llguidance.LLTokenizer(
                tokenizer_json(self.tokenizer), n_vocab=n_vocab, eos_token=eos
            )
            self._executor = llguidance.LLExecutor(num_threads=2)
        return self._ll_tokenizer

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state at the start of ``spec``'s grammar (admitted: ``check_grammar`` passed)."""
        template = self._cache.get(spec)
        if template is None:
            # Admission checked the grammar (check_grammar); what can still fail here is this
            # tokenizer's vocabulary against it.
            template = llguidance.LLMatcher(self._tokenizer(), grammar_text(spec), log_level=0)
            if template.is_error():
                raise InvalidRequestError(
                    f"{spec.field}: the {spec.kind.value} cannot be compiled: {template.get_error()}",
                    spec.field,
                )
            self.compiled += 1
            self._cache[spec] = template
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return GrammarState(template.deep_copy(), self._executor, self._ll_tokenizer.vocab_size)


def allowed_tokens(states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
    """Which tokens each state allows next, as a bool tensor ``[len(states), vocab_size]``.

    llguidance fills a packed bitmask (32 tokens per int32) for all states in one call; it is
    unpacked with tensor ops. Ids past the grammar's vocabulary are never allowed.
    """
    n_words = (states[0].n_vocab + 31) // 32
    bitmask = torch.zeros(len(states), n_words, dtype=torch.int32)
    pairs = [(s.matcher, i) for i, s in enumerate(states)]
    states[0].executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), n_words * 4, len(states))
    n_bits = n_words * 32
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(states), n_bits).bool()
    if n_bits >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - n_bits), value=False)
