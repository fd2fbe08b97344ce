"""The trie of a group's responses (`engine/trie.py`): segments, members, children."""

import torch

from longstraw.engine.trie import build_trie


def _t(*ids):
    return torch.tensor(ids, dtype=torch.long)


def _shape(seg):
    return (seg.start, seg.end, seg.members, [_shape(c) for c in seg.children])


def test_two_levels_and_a_response_that_ends_at_a_fork():
    root = build_trie([_t(1, 2, 3, 4), _t(1, 2, 3, 5, 6), _t(1, 2, 7), _t(1, 2, 3)])
    assert _shape(root) == (0, 2, [0, 1, 2, 3], [
        (2, 3, [0, 1, 3], [(3, 4, [0], []), (3, 5, [1], [])]),
        (2, 3, [2], []),
    ])
    assert root.forwarded_tokens() == 2 + 1 + 1 + 2 + 1 == 7
    assert root.shared_segments() == 2


def test_nothing_shared_gives_an_empty_root_and_one_leaf_per_response():
    root = build_trie([_t(1, 2), _t(3), _t(4, 5, 6)])
    assert _shape(root) == (0, 0, [0, 1, 2], [(0, 2, [0], []), (0, 1, [1], []), (0, 3, [2], [])])
    assert root.forwarded_tokens() == 6 and root.shared_segments() == 0


def test_identical_responses_and_g_1():
    assert _shape(build_trie([_t(1, 2), _t(1, 2)])) == (0, 2, [0, 1], [])
    assert _shape(build_trie([_t(9)])) == (0, 1, [0], [])


def test_masks_split_a_run_where_they_differ():
    responses = [_t(1, 2, 3, 4), _t(1, 2, 3, 4)]
    masks = [torch.tensor([True, True, False, True]), torch.tensor([True, True, True, True])]
    assert _shape(build_trie(responses, masks)) == (0, 2, [0, 1], [(2, 4, [0], []), (2, 4, [1], [])])
    assert _shape(build_trie(responses)) == (0, 4, [0, 1], [])  # score's trie ignores masks
