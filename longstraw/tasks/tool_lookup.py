"""Tool lookup: an agent task whose answer needs both the long prompt and a tool.

The prompt is a `KVRecall` haystack of record tokens: each record stands for a pair
(key -> id), and the question asks for one key. The ids mean nothing by themselves:
only the lookup tool maps an id to the answer, through a table drawn per prompt and
never shown in the prompt. One episode, two turns:

    prompt:    ... filler ... REC(k2 -> id5) ... filler ... QUERY k2
    turn 1:    id5 EOS                      the policy reads the record, calls the tool
    tool:      RESULT a3                    the observation (loss mask False)
    turn 2:    a3 EOS                       the policy answers

So a policy that skips the prompt cannot name the id, and one that skips the tool
cannot know the answer (a blind guess is right 1 / num_answers of the time).

`environment(item)` is the tool, in `Engine.generate(environment=...)`'s form:
env(branch, response) is called when the first turn ends: a response of exactly `id EOS`
with a valid id gets [RESULT, table[id]]; anything else is not a tool call, and the
branch ends (None).

Reward, in [0, 1], from the final answer only: after the tool call and its observation
the response must be the answer then EOS (1.0); the right answer with anything else
after it earns 0.5; no tool call, or a wrong answer (a wrong id leads there), earns 0. `exact_match` is
reward == 1. Everything is a pure function of (split, index), as in `kv_recall.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_recall import KVRecall, Vocab

RESULT = 4  # the observation's marker: one of kv_recall's unused ids [4, 8)


@dataclass(frozen=True)
class LookupItem:
    """One episode's data: prompt [P], the record's id, the tool's table, the answer."""

    prompt: torch.Tensor      # (P,) int64, ends with QUERY key
    record_id: int            # the id the queried key points to (turn 1's answer)
    table: torch.Tensor       # (num_values,) int64: the tool's answer token for each id (distinct)
    answer: int               # table[record_id]: the final answer

    @property
    def observation(self) -> torch.Tensor:
        """What the tool returns for the right id. (2,)"""
        return torch.tensor([RESULT, self.answer])

    @property
    def target(self) -> torch.Tensor:
        """The ideal response: id EOS | RESULT answer | answer EOS. (6,)"""
        return torch.cat([torch.tensor([self.record_id, Vocab.EOS]), self.observation,
                          torch.tensor([self.answer, Vocab.EOS])])

    @property
    def target_mask(self) -> torch.Tensor:
        """The ideal response's loss mask: False at the observation. (6,) bool"""
        return torch.tensor([True, True, False, False, True, True])


_TABLE_SALT = {"train": 0x7AB1_E000, "heldout": 0x7AB1_E000_0000}  # the tables' own seed streams


class ToolLookup:
    """Tool lookup at prompt length P (see the module docstring).

    Args:
        prompt_tokens: P, the whole prompt including the question.
        num_facts: records in the haystack (distinct keys, distinct ids).
        fact_region: records sit in the first `fact_region` fraction of the haystack.
        vocab: the haystack's id layout (`records` is forced on: one token per record);
            its `num_values` are the ids.
        num_answers: the tool's answer tokens, ids [vocab.size, vocab.size + num_answers).
        seed: the task's seed.
    """

    max_turns = 1
    """Tool calls per episode."""
    response_tokens = 6
    """max_new_tokens of an episode: id EOS, RESULT answer (the observation), answer EOS."""

    def __init__(self, prompt_tokens: int, *, num_facts: int = 4, fact_region: float = 1.0,
                 vocab: Vocab = Vocab(records=True), num_answers: int = 8, seed: int = 0):
        if num_answers < vocab.num_values:
            raise ValueError(f"num_answers={num_answers} must be >= the ids' num_values={vocab.num_values}, so that "
                             "distinct ids look up distinct answers (a wrong id never finds the right answer)")
        vocab = Vocab(num_values=vocab.num_values, num_keys=vocab.num_keys, num_filler=vocab.num_filler, records=True)
        self.records = KVRecall(prompt_tokens, num_facts=num_facts, num_queries=1, fact_region=fact_region,
                                vocab=vocab, seed=seed)
        self.vocab, self.num_answers, self.seed = vocab, num_answers, seed
        self.prompt_tokens, self.num_facts, self.num_queries = prompt_tokens, num_facts, 1

    @property
    def answer_base(self) -> int:
        return self.vocab.size

    @property
    def vocab_size(self) -> int:
        """The smallest vocab_size a model needs for this task."""
        return self.answer_base + self.num_answers

    def item(self, split: str, index: int) -> LookupItem:
        """The `index`-th episode of `split` ("train" or "heldout")."""
        rec = self.records.item(split, index)
        g = torch.Generator().manual_seed(_TABLE_SALT[split] + self.seed * 1_000_003 + index)  # split checked above
        table = torch.randperm(self.num_answers, generator=g)[: self.vocab.num_values] + self.answer_base  # injective
        record_id = int(rec.answer[0])
        return LookupItem(prompt=rec.prompt, record_id=record_id, table=table,
                          answer=int(table[record_id - self.vocab.value_base]))

    def environment(self, item: LookupItem):
        """The lookup tool for `item`: env(branch, response) -> LongTensor [2] or None."""
        def env(branch: int, response: torch.Tensor):
            called = self.called_id(response)
            if called is None or response.numel() != 2:
                return None  # not a tool call: the branch ends without an answer
            return torch.tensor([RESULT, int(item.table[called - self.vocab.value_base])])
        return env

    def called_id(self, response: torch.Tensor) -> int | None:
        """The id of the tool call `id EOS` the response starts with, or None."""
        base, ids = self.vocab.value_base, self.vocab.num_values
        head = response[:2].tolist()
        return head[0] if len(head) == 2 and head[1] == Vocab.EOS and base <= head[0] < base + ids else None

    def reward(self, item: LookupItem, response: torch.Tensor) -> float:
        """Score one response in [0, 1] from its final answer (see the module docstring)."""
        called = self.called_id(response)
        if called is None or response.numel() < 4:
            return 0.0  # no tool call, or no observation
        return reward(item.answer, response[4:])


def reward(answer: int, final: torch.Tensor) -> float:
    """The final turn's score: 1.0 for `answer EOS`, 0.5 for the right answer followed by
    anything else (or nothing), 0 for a wrong answer."""
    got = final.tolist()
    if not got or got[0] != answer:
        return 0.0
    return 1.0 if got == [answer, Vocab.EOS] else 0.5


def exact_match(task: ToolLookup, item: LookupItem, response: torch.Tensor) -> bool:
    return task.reward(item, response) == 1.0
