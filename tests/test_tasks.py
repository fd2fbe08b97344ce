"""The key-value recall task: deterministic from its seed, disjoint splits, facts where
they should be, and the reward on hand-made responses."""

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
