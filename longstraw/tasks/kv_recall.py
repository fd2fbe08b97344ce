"""Key-value recall in a long haystack: a long-context task with a verifiable reward.

A prompt is P tokens of random filler with `num_facts` facts scattered through it,
then a question about `num_queries` of those facts:

    ... filler ... FACT k1 v1 ... filler ... FACT k2 v2 ... filler ... QUERY k2 k1
    response:  v2 v1 EOS

(or, with `Vocab(records=True)`, each fact is one record token standing for (k, v)).

The facts sit in the first `fact_region` fraction of the haystack, so every answer
depends on tokens at least (1 - fact_region) * P positions back. Nothing here needs a
tokenizer: the tiny built-in models work on raw token ids, and the id ranges are
reserved (`Vocab`): specials, values, keys, filler. The facts' keys are distinct and so
are their values (drawn from a small set), so a policy that has learned the format but
not the retrieval is right by chance (1 / num_values blind, 1 / num_facts when it picks
one of the values in the prompt) and GRPO gets a dense signal.

Everything is a pure function of (split seed, index): `KVRecall(...).item("train", i)`
gives the same prompt on every machine, and the train and held-out splits use disjoint
seed streams, so no held-out prompt is ever trained on.

Reward, in [0, 1]: the fraction of queried values given correctly, in order, halved
when the response is not exactly `num_queries` tokens followed by EOS (so a right
answer with trailing junk or no EOS still earns partial credit). `exact_match` (the
held-out "accuracy") is reward == 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------
# the vocabulary: reserved id ranges


@dataclass(frozen=True)
class Vocab:
    """Id layout: 0 PAD, 1 EOS, 2 FACT, 3 QUERY, [4, 8) unused markers, then values,
    keys, filler, and (with `records`) one id per (key, value) pair.

    With `records=False` a fact is three tokens, `FACT key value`: looking it up takes a
    previous-token step and a match (an induction circuit, two attention layers). With
    `records=True` a fact is one record token that stands for the pair, like a row id
    in a table: the lookup is one attention match, which tiny models learn in seconds.
    """

    num_values: int = 8
    num_keys: int = 32
    num_filler: int = 80
    records: bool = False

    PAD = 0
    EOS = 1
    FACT = 2
    QUERY = 3
    SPECIALS = 8  # ids [0, 8) are reserved for markers

    @property
    def value_base(self) -> int:
        return self.SPECIALS

    @property
    def key_base(self) -> int:
        return self.value_base + self.num_values

    @property
    def filler_base(self) -> int:
        return self.key_base + self.num_keys

    @property
    def record_base(self) -> int:
        return self.filler_base + self.num_filler

    def record(self, key: int, value: int) -> int:
        """The record id of (key id, value id)."""
        return self.record_base + (key - self.key_base) * self.num_values + (value - self.value_base)

    @property
    def size(self) -> int:
        """The smallest vocab_size a model needs for this task."""
        return self.record_base + (self.num_keys * self.num_values if self.records else 0)


@dataclass(frozen=True)
class Item:
    """One task instance: prompt [P] (ends with the question), and the target answer."""

    prompt: torch.Tensor      # (P,) int64, ends with the queried keys
    answer: torch.Tensor      # (num_queries,) int64: the queried values, in order
    fact_positions: tuple     # where each fact starts, for inspection

    @property
    def target(self) -> torch.Tensor:
        """The ideal response: answer tokens then EOS. (num_queries + 1,)"""
        return torch.cat([self.answer, torch.tensor([Vocab.EOS])])

    @property
    def target_mask(self) -> torch.Tensor:
        """The ideal response's loss mask: every token is the policy's. (num_queries + 1,) bool"""
        return torch.ones(self.answer.numel() + 1, dtype=torch.bool)


_SPLIT_SALT = {"train": 0x5EED_0000, "heldout": 0x5EED_8000_0000}


class KVRecall:
    """Key-value recall at prompt length P.

    Args:
        prompt_tokens: P, the whole prompt including the question.
        num_facts: facts in the haystack (distinct keys, distinct values).
        num_queries: facts asked about (answer length before EOS).
        fact_region: facts are placed in the first `fact_region` fraction of the
            haystack (1.0: anywhere).
        vocab: the id layout.
        seed: the task's seed; with the split it selects the seed stream.
    """

    def __init__(self, prompt_tokens: int, *, num_facts: int = 4, num_queries: int = 1, fact_region: float = 1.0,
                 vocab: Vocab = Vocab(), seed: int = 0):
        if num_facts > min(vocab.num_keys, vocab.num_values):
            raise ValueError(f"num_facts={num_facts} needs as many distinct keys and values, have "
                             f"num_keys={vocab.num_keys}, num_values={vocab.num_values}")
        if not 1 <= num_queries <= num_facts:
            raise ValueError(f"num_queries must be in [1, num_facts={num_facts}], got {num_queries}")
        if not 0 < fact_region <= 1:
            raise ValueError(f"fact_region must be in (0, 1], got {fact_region}")
        question = 1 + num_queries  # QUERY k..
        self.haystack = prompt_tokens - question
        if self.haystack < 3 * num_facts:
            raise ValueError(f"prompt_tokens={prompt_tokens} is too short for {num_facts} facts and the question")
        self.prompt_tokens, self.num_facts, self.num_queries = prompt_tokens, num_facts, num_queries
        self.fact_region, self.vocab, self.seed = fact_region, vocab, seed

    max_turns = 0
    """Single turn: no environment (`environment` returns None)."""

    @property
    def response_tokens(self) -> int:
        """max_new_tokens of a response: the answer, then EOS."""
        return self.num_queries + 1

    @property
    def vocab_size(self) -> int:
        """The smallest vocab_size a model needs for this task."""
        return self.vocab.size

    def environment(self, item: Item):
        """None: a single-turn task has no environment (the agent task's form, `tool_lookup.py`)."""
        return None

    def _generator(self, split: str, index: int) -> torch.Generator:
        if split not in _SPLIT_SALT:
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        return torch.Generator().manual_seed(_SPLIT_SALT[split] + self.seed * 1_000_003 + index)

    def item(self, split: str, index: int) -> Item:
        """The `index`-th instance of `split` ("train" or "heldout")."""
        v, g = self.vocab, self._generator(split, index)
        hay = torch.randint(v.filler_base, v.filler_base + v.num_filler, (self.haystack,), generator=g)
        keys = torch.randperm(v.num_keys, generator=g)[: self.num_facts] + v.key_base
        values = torch.randperm(v.num_values, generator=g)[: self.num_facts] + v.value_base
        # non-overlapping slots (3 tokens, or 1 record token) in the first fact_region of the haystack
        width = 1 if v.records else 3
        slots = max(self.num_facts, int(self.haystack * self.fact_region) // width)
        starts = torch.randperm(slots, generator=g)[: self.num_facts].sort().values * width
        for s, k, val in zip(starts.tolist(), keys.tolist(), values.tolist()):
            hay[s : s + width] = torch.tensor([v.record(k, val)] if v.records else [v.FACT, k, val])
        asked = torch.randperm(self.num_facts, generator=g)[: self.num_queries]
        question = torch.cat([torch.tensor([v.QUERY]), keys[asked]])
        return Item(prompt=torch.cat([hay, question]), answer=values[asked].clone(), fact_positions=tuple(starts.tolist()))

    def reward(self, item: Item, response: torch.Tensor) -> float:
        """Score one response in [0, 1] (see the module docstring)."""
        return reward(item.answer, response)


def reward(answer: torch.Tensor, response: torch.Tensor) -> float:
    """Fraction of answer tokens matched position by position; halved unless the
    response is exactly the answer's length followed by EOS."""
    n = answer.numel()
    got = response[:n].tolist()
    correct = sum(int(a == b) for a, b in zip(answer.tolist(), got))
    well_formed = response.numel() == n + 1 and int(response[n]) == Vocab.EOS
    return correct / n * (1.0 if well_formed else 0.5)


def exact_match(answer: torch.Tensor, response: torch.Tensor) -> bool:
    return reward(answer, response) == 1.0
