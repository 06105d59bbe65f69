"""What the load generator sends: token-count distributions and synthesized prompts.

Prompts are made of common short English words, each preceded by a space. Byte-pair and
SentencePiece vocabularies (Llama, Mistral, GPT-2) hold nearly all of them as single tokens, so a
prompt of N words is close to N tokens without downloading a tokenizer or a data set. Every request
draws its own words from a generator seeded by ``(seed, index)``: the workload is reproducible and
independent of how many workers send it, and no two prompts share a long prefix (so a server's
prefix cache cannot flatter the numbers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_TEXT = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three small house water light river tree green blue stone road city south "
    "north east west open close word line music story paper book table door window hand head eye"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class TokenCount:
    """A token-count distribution: ``fixed``, ``uniform`` (inclusive bounds) or ``normal``.

    Samples are integers of at least ``minimum`` (a normal draw is clipped there).
    """

    kind: str
    a: float
    b: float = 0.0
    minimum: int = 1

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            value = rng.gauss(self.a, self.b)
        return max(self.minimum, round(value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_token_count(text: str) -> TokenCount:
    """Parse ``N``, ``uniform:LOW:HIGH`` or ``normal:MEAN:STDDEV``; raise ValueError naming the value."""
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            value = int(parts[0])
            if value < 1:
                raise ValueError
            return TokenCount("fixed", value)
        kind, first, second = parts[0].lower(), float(parts[1]), float(parts[2]) if len(parts) == 3 else None
    except (ValueError, IndexError):
        raise ValueError(
            f"token count {text!r}: expected N, uniform:LOW:HIGH or normal:MEAN:STDDEV"
        ) from None
    if second is None:
        raise ValueError(f"token count {text!r}: {kind} needs two numbers")
    if kind == "uniform":
        if not 1 <= first <= second:
            raise ValueError(f"token count {text!r}: need 1 <= LOW <= HIGH")
        return TokenCount("uniform", int(first), int(second))
    if kind == "normal":
        if first < 1 or second < 0:
            raise ValueError(f"token count {text!r}: need MEAN >= 1 and STDDEV >= 0")
        return TokenCount("normal", first, second)
    raise ValueError(f"token count {text!r}: unknown distribution {kind!r} (fixed, uniform, normal)")


def synthesize_prompt(rng: random.Random, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of word salad, starting with an instruction so models keep writing."""
    head = "Continue the story:"
    n_words = max(1, n_tokens - 5)  # the head is about five tokens
    return head + "".join(" " + rng.choice(_WORDS) for _ in range(n_words))


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of the workload: its index, prompt and token targets."""

    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    """Deterministic request factory: request ``i`` is the same for every run with the same seed."""

    prompt_tokens: TokenCount
    output_tokens: TokenCount
    seed: int = 0

    def request(self, index: int) -> BenchRequest:
        rng = random.Random(self.seed * 1_000_003 + index)
        n_prompt = self.prompt_tokens.sample(rng)
        n_output = self.output_tokens.sample(rng)
        return BenchRequest(index, synthesize_prompt(rng, n_prompt), n_prompt, n_output)
