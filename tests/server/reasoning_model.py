"""A tiny Llama whose greedy output is a script, for testing reasoning output through the real engine.

A random model never writes ``<think>``, so this one is built to: attention and MLP outputs are
zero, so the last hidden state is the embedding of the current token, and the output head maps
each scripted token to its successor (a bigram model). With ``temperature: 0`` every request whose
prompt ends where a script begins gets exactly that script::

    "\\n" or <｜Assistant｜>  ->  <think> Let me think </think> "\\n\\n" Hello ! <eos>

A second-best successor makes a branch that ``logit_bias`` takes: +10 on ``<tool_call>`` turns the
answer into ``<tool_call>{"name":"get_time"}</tool_call>``; -100 on ``<think>`` starts the thinking
without the tag (how DeepSeek-R1 writes after a template that ends with ``<think>\\n``). Any other
token leads to EOS. The tokenizer is SmolLM2's plus the added tokens Qwen3's and DeepSeek-R1's
vocabularies have (non-special, as theirs are), and the chat template is one of the real ones in
``tests/data/chat_templates``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from neuron_lmi.testing.checkpoints import TINY_BASE, save_smollm2_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<｜User｜>", "<｜Assistant｜>")
THINKING = "Let me think"
ANSWER = "\n\nHello!"
ANSWER_TOKENS = ("ĊĊ", "Hello", "!")  # as a model writes it ("\n\n" alone is one token)
CALL = '{"name":"get_time"}'
# Logits of a scripted successor and of the second-best one (the branch logit_bias can take).
FIRST, SECOND = 30.0, 25.0


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def script(tok: Any) -> dict[int, list[int]]:
    """Token id -> its successors, best first (the model's only non-EOS choices)."""
    think, end, call, call_end = tok.convert_tokens_to_ids(
        ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    )
    thinking, body = _ids(tok, THINKING), _ids(tok, CALL)
    answer = list(tok.convert_tokens_to_ids(list(ANSWER_TOKENS)))
    eos = int(tok.eos_token_id)
    edges: dict[int, list[int]] = {}

    def chain(tokens: list[int]) -> None:
        for a, b in itertools.pairwise(tokens):
            edges.setdefault(a, []).append(b)

    for start in (_ids(tok, "\n")[-1], tok.convert_tokens_to_ids("<｜Assistant｜>")):
        edges[start] = [think, thinking[0]]
    chain([think, *thinking, end, *answer, eos])
    chain([end, call, *body, call_end, eos])
    branches = {end, *(t for t, v in edges.items() if v[0] == think)}
    if any(len(v) != (2 if t in branches else 1) for t, v in edges.items()):
        raise ValueError(f"the script reuses a token; pick other words: {edges}")
    return edges


def make_scripted_checkpoint(out_dir: Path, template: str) -> Path:
    """Write the scripted model with ``tests/data/chat_templates/<template>.jinja`` into ``out_dir``."""
    from transformers import AddedToken, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    save_smollm2_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    tok.save_pretrained(str(out_dir))
    edges = script(tok)
    slots = {token: k for k, token in enumerate(edges, start=1)}  # slot 0: every other token
    hidden = int(TINY_BASE["hidden_size"])
    if len(slots) >= hidden:
        raise ValueError(f"{len(slots)} scripted tokens need a hidden size above {hidden}")
    config = LlamaConfig(
        **TINY_BASE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    model = LlamaForCausalLM(config).eval()
    scale = hidden**-0.5  # RMSNorm turns a one-hot embedding into sqrt(hidden) times itself
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 0] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[int(tok.eos_token_id), 0] = FIRST * scale
        for token, k in slots.items():
            embed[token].zero_()
            embed[token, k] = 1.0
            for successor, logit in zip(edges[token], (FIRST, SECOND), strict=False):
                head[successor, k] = logit * scale
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
