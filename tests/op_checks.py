"""Checks shared by the registered ops' tests: an op against the plain loop it wraps."""

import torch
from torch.utils.flop_counter import FlopCounterMode


def assert_op_is_its_loop(op, loop, args: list, mutated: list[int]) -> None:
    """op(*args) and loop(*a copy of args) count the same FLOPs (and some), and leave the
    same values in the arguments at the `mutated` indices."""
    again = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
    with FlopCounterMode(display=False) as registered:
        op(*args)
    with FlopCounterMode(display=False) as plain:
        loop(*again)
    assert registered.get_total_flops() == plain.get_total_flops() > 0
    for i in mutated:
        assert torch.equal(args[i], again[i]), i
