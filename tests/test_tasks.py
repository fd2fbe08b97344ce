"""The key-value recall task: deterministic from its seed, disjoint splits, facts where
they should be, and the reward on hand-made responses. The tool-lookup agent task: the
prompt's record names the id, the tool maps it to the answer, and the reward is the
final answer's (a scripted perfect policy gets 1, a wrong id 0)."""

import pytest
import torch

from longstraw.tasks import KVRecall, Vocab, exact_match, reward

V = Vocab()


def test_deterministic_and_splits_disjoint():
    task = KVRecall(512, num_facts=4, num_queries=2)
    a, b = task.item("train", 7), KVRecall(512, num_facts=4, num_queries=2).item("train", 7)
    assert torch.equal(a.prompt, b.prompt) and torch.equal(a.answer, b.answer)
    assert not torch.equal(task.item("train", 8).prompt, a.prompt)
    train = {tuple(task.item("train", i).prompt.tolist()) for i in range(50)}
    held = {tuple(task.item("heldout", i).prompt.tolist()) for i in range(50)}
    assert not train & held
    assert not torch.equal(KVRecall(512, seed=1).item("train", 7).prompt, KVRecall(512, seed=0).item("train", 7).prompt)


@pytest.mark.parametrize("records", [False, True])
def test_layout_facts_and_question(records):
    vocab = Vocab(num_values=8, num_keys=8, records=records)
    task = KVRecall(1000, num_facts=4, num_queries=2, fact_region=0.25, vocab=vocab)
    for i in range(20):
        it = task.item("heldout", i)
        p = it.prompt
        assert p.shape == (1000,) and p.dtype == torch.int64 and int(p.max()) < vocab.size and int(p.min()) >= 0
        assert int(p[-3]) == V.QUERY
        asked = p[-2:].tolist()
        # recover every fact from the haystack and check the answer is their lookup
        facts = {}
        for s in it.fact_positions:
            assert s < 0.25 * task.haystack
            if records:
                r = int(p[s]) - vocab.record_base
                facts[vocab.key_base + r // vocab.num_values] = vocab.value_base + r % vocab.num_values
            else:
                assert int(p[s]) == V.FACT
                facts[int(p[s + 1])] = int(p[s + 2])
        assert len(facts) == 4 and len(set(facts.values())) == 4  # distinct keys, distinct values
        assert it.answer.tolist() == [facts[k] for k in asked]
        assert it.target.tolist() == it.answer.tolist() + [V.EOS]
        hay = p[:-3]
        n_marked = int((hay >= vocab.record_base).sum()) if records else int((hay == V.FACT).sum())
        assert n_marked == 4  # filler never forms a fact


def test_reward_hand_made():
    answer = torch.tensor([10, 12])
    E = V.EOS
    assert reward(answer, torch.tensor([10, 12, E])) == 1.0
    assert reward(answer, torch.tensor([10, 13, E])) == 0.5      # one of two right
    assert reward(answer, torch.tensor([12, 10, E])) == 0.0      # order matters
    assert reward(answer, torch.tensor([10, 12])) == 0.5         # right, but no EOS: halved
    assert reward(answer, torch.tensor([10, 12, 12])) == 0.5     # trailing junk instead of EOS
    assert reward(answer, torch.tensor([10, 12, E, E])) == 0.5   # too long
    assert reward(answer, torch.tensor([10, E])) == 0.25         # stopped early: 1/2, halved
    assert reward(answer, torch.tensor([E])) == 0.0
    assert exact_match(answer, torch.tensor([10, 12, E])) and not exact_match(answer, torch.tensor([10, 12]))
    one = torch.tensor([9])
    assert reward(one, torch.tensor([9, E])) == 1.0 and reward(one, torch.tensor([8, E])) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_queries"):
        KVRecall(100, num_facts=2, num_queries=3)
    with pytest.raises(ValueError, match="too short"):
        KVRecall(8, num_facts=4)
    with pytest.raises(ValueError, match="split"):
        KVRecall(100).item("test", 0)
    with pytest.raises(ValueError, match="distinct"):
        KVRecall(100, num_facts=9, vocab=Vocab(num_values=8))


# ----------------------------------------------------------------------------
# tool lookup: the agent task (prompt record -> id, tool id -> answer)

from longstraw.tasks import ToolLookup  # noqa: E402
from longstraw.tasks.tool_lookup import RESULT  # noqa: E402


def _lookup():
    return ToolLookup(600, num_facts=4, fact_region=0.5, vocab=Vocab(num_values=8, num_keys=8, num_filler=20),
                      num_answers=10)


def _episode(task, item, first_turn):
    """A scripted policy: `first_turn`, then (if the tool answered) copy its answer, EOS."""
    response = torch.tensor(first_turn)
    obs = task.environment(item)(0, response)
    if obs is None:
        return response
    return torch.cat([response, obs, torch.tensor([int(obs[1]), Vocab.EOS])])


def test_tool_lookup_needs_the_prompts_record_and_the_tool():
    task = _lookup()
    v = task.vocab
    for i in range(20):
        item = task.item("train", i)
        key = int(item.prompt[-1])  # QUERY key
        records = [int(t) for t in item.prompt if int(t) >= v.record_base]
        ids = [(r - v.record_base) % v.num_values + v.value_base for r in records
               if (r - v.record_base) // v.num_values + v.key_base == key]
        assert ids == [item.record_id]  # the queried key's record in the prompt names the id
        assert item.answer not in item.prompt.tolist()  # the answer is never in the prompt
        assert len(set(item.table.tolist())) == v.num_values  # distinct ids, distinct answers
        assert all(task.answer_base <= a < task.vocab_size for a in item.table.tolist())
        env = task.environment(item)
        assert torch.equal(env(3, torch.tensor([item.record_id, Vocab.EOS])), torch.tensor([RESULT, item.answer]))
        assert torch.equal(_episode(task, item, [item.record_id, Vocab.EOS]), item.target)
    assert len({task.item("train", i).answer for i in range(40)}) > 1  # the answer varies with the item
    assert torch.equal(task.item("heldout", 0).table, _lookup().item("heldout", 0).table)  # a pure function
    assert not torch.equal(task.item("heldout", 0).prompt, task.item("train", 0).prompt)


def test_tool_lookup_rewards_the_final_answer():
    task = _lookup()
    for i in range(10):
        item = task.item("heldout", i)
        wrong = next(x for x in range(task.vocab.value_base, task.vocab.key_base) if x != item.record_id)
        assert task.reward(item, _episode(task, item, [item.record_id, Vocab.EOS])) == 1.0  # the perfect policy
        assert task.reward(item, _episode(task, item, [wrong, Vocab.EOS])) == 0.0  # a wrong id: a wrong answer
        obs = item.observation.tolist()
        call = [item.record_id, Vocab.EOS]
        assert task.reward(item, torch.tensor(call + obs + [item.answer, 7, Vocab.EOS])) == 0.5  # trailing junk
        assert task.reward(item, torch.tensor(call + obs + [item.answer])) == 0.5  # no EOS
        assert task.reward(item, torch.tensor(call + obs)) == 0.0  # no answer
        assert task.reward(item, torch.tensor([item.answer, Vocab.EOS])) == 0.0  # no tool call
        # not a tool call: the tool does not answer, and the branch ends
        env = task.environment(item)
        for turn in ([item.record_id], [item.record_id, 9, Vocab.EOS], [task.vocab.key_base, Vocab.EOS],
                     [Vocab.EOS]):
            assert env(0, torch.tensor(turn)) is None, turn
    assert torch.equal(task.item("train", 0).target_mask, torch.tensor([True, True, False, False, True, True]))
    with pytest.raises(ValueError, match="num_answers"):
        ToolLookup(100, vocab=Vocab(num_values=8), num_answers=4)
