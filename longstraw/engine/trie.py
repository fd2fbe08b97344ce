"""The trie of a group's responses below the prompt: which response tokens are shared.

Response i is replayed as inputs x_i = [prompt[-1]] + r_i[:-1] against targets r_i;
input j sits at absolute position P - 1 + j. If responses agree on every target before
position b, they agree on every input up to b too (x_i[j] = r_i[j - 1]): their hidden
states, state rows and log-probs at targets [0, b) are the same. So a run of target
positions [start, end) that a set of responses shares is computed once, against the
prompt state plus the states of the runs above it, and its children start at `end`
with the input r[end - 1], which every member shares (as a branch starts with the
prompt's last token).

Two responses share a position when they have the same token AND the same loss mask
value there (`share_masks`; step's trie): a position whose masks differ is not shared,
so every shared token has one mask value. (Sharing across differing masks would be
correct too, each member's loss term taking its own mask, but the contract says no.)
`score` ignores masks and shares on tokens alone.

Shapes: R_i response lengths; a `Segment` holds target positions [start, end) of each
of its members' responses (relative to the response, 0 = its first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.host import on_host


@dataclass
class Segment:
    """A maximal run of response positions that the same responses share.

    Fields:
        start, end: target positions [start, end) of every member's response.
        members: response indices (group order) holding exactly these tokens there;
            one member: a response's own unshared tail.
        children: the segments below, from position `end` (none: every member ends at
            `end`). The root may be empty (start == end == 0): the responses already
            differ at their first token.
    """

    start: int
    end: int
    members: list[int]
    children: list["Segment"] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def walk(self):
        """Every segment of the subtree, depth first, parents before children."""
        yield self
        for child in self.children:
            yield from child.walk()

    def forwarded_tokens(self) -> int:
        """Tokens the trie runs through the model: each shared one once."""
        return sum(s.tokens for s in self.walk())

    def shared_segments(self) -> int:
        """Non-empty segments held by two or more responses."""
        return sum(1 for s in self.walk() if s.tokens > 0 and len(s.members) > 1)


def _keys(responses, masks) -> list[torch.Tensor]:
    """Per response a LongTensor [R_i] on the CPU: token * 2 + mask bit (mask 1 without masks)."""
    out = []
    for i, r in enumerate(responses):
        bit = 1 if masks is None else masks[i].detach().to("cpu", torch.long)
        out.append(r.detach().to("cpu", torch.long) * 2 + bit)
    return out


def build_trie(responses: list[torch.Tensor], masks: list[torch.Tensor] | None = None) -> Segment:
    """The trie of `responses` (G LongTensors [R_i]), keyed by (token, mask) when `masks`
    (G bool [R_i]) are given, by token alone otherwise. Returns its root segment, which
    starts at position 0. Cost: O(G * R) comparisons on the CPU, no model work."""
    with on_host():  # the token ids are real, also in a rehearsal (`longstraw/host.py`)
        keys = _keys(responses, masks)
        return _grow(keys, list(range(len(keys))), 0)


def _grow(keys: list[torch.Tensor], members: list[int], start: int) -> Segment:
    """The segment `members` (sharing keys [0, start)) hold from `start`, and below it."""
    lead = keys[members[0]]
    end = min(int(keys[i].numel()) for i in members)
    for i in members[1:]:
        differ = torch.nonzero(keys[i][start:end] != lead[start:end])
        if differ.numel():
            end = start + int(differ[0, 0])
    by_key: dict[int, list[int]] = {}
    for i in members:
        if keys[i].numel() > end:  # the others end here
            by_key.setdefault(int(keys[i][end]), []).append(i)
    return Segment(start, end, members, [_grow(keys, group, end) for group in by_key.values()])
