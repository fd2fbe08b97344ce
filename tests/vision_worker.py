"""Worker for tests/parallel/test_distributed.py's images case (spawned, gloo, CPU, float64):
a prompt with two images under context parallelism at W = 2 and 3 against one process.

The tiny Qwen3.5 VLM of `tests/vision_reference.py` (GDN + attention text model, one-block
tower) on a 20-token prompt with two images of different grids, dealt in blocks of 3
positions. At W = 2 the first image's rows lie on both ranks and the second's all on rank
0, while the deal of images for the tower (`models/vision.deal_images`) gives rank 0 the
first and rank 1 the second: each rank's tower needs rows the other rank's walk read. At
W = 3 the third rank runs no image (its tower gradient is a zero partial); W = 3 runs the
divided exact step only. Each configuration's loss and every parameter gradient, the
vision tower's included, equal the single-process step's on every rank, to FLOAT64, under
`float64_throughout`; a greedy agent episode over the sharded state gives one process's
tokens and log-probs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import longstraw as ls
from tests.distributed_worker import _init, run_cases
from tests.reference import FLOAT64, assert_grads_close, assert_loss_close, float64_throughout, grads_of
from tests.vision_reference import image_prompt, text_responses, tiny_vlm

LAYOUT = [3, "img", 2, "img", 4]
GRIDS = [(1, 4, 4), (1, 2, 6)]
CONFIGS = [  # (mode, extra ExecConfig, divided walk expected)
    ("detached", {}, False),
    ("exact", {}, True),  # divided capture and walk: the image rows' gradient partial on each rank
    ("exact", dict(divide_capture=False, divide_walk=False), False),  # replicated walk: complete on each
]


def run_images(rank: int, world: int, init_file: str, configs=CONFIGS, decode: bool = True) -> None:
    _init(rank, world, init_file)
    try:
        model = tiny_vlm()
        prompt, inputs = image_prompt(LAYOUT, grids=GRIDS, seed=0)
        group = ls.Group(prompt=prompt, responses=text_responses((4, 1, 6), seed=1),
                         rewards=torch.tensor([1.0, 0.0, 0.5]), prompt_inputs=inputs)
        for mode, extra, divided in configs:
            kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3, mode=mode, **extra)
            with float64_throughout(model):
                model.zero_grad(set_to_none=True)
                single = ls.Engine(model, ls.ExecConfig(**kw)).step(group)
                want = grads_of(model)
                model.zero_grad(set_to_none=True)
                result = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw)).step(group)
                got = grads_of(model)
            assert result.metrics["divided_walk"] == float(divided), (mode, extra, result.metrics["divided_walk"])
            assert_loss_close(result.loss, single.loss, FLOAT64)
            assert_grads_close(got, want, FLOAT64)
            tower = [g for n, g in got.items() if ".visual." in n]
            if mode == "exact":
                assert all(g is not None and g.abs().max() > 0 for g in tower), (mode, extra)
            else:
                assert all(g is None for g in tower), mode
        if decode:
            _greedy_episode(model, prompt, inputs)
    finally:
        dist.destroy_process_group()


def _observation(branch: int, response: torch.Tensor) -> torch.Tensor:
    """A deterministic tool observation of text tokens (< 89: no image placeholder)."""
    return torch.tensor([(int(response.sum()) + 7 * branch + 13 * j) % 89 for j in range(2 + branch)])


def _greedy_episode(model, prompt, inputs) -> None:
    """Decode under context parallelism continues from the prompt's rope_deltas: a greedy
    agent episode (a tool observation absorbed mid-response) over the sharded state gives
    one process's tokens, turns and masks, and its log-probs to FLOAT64."""
    with float64_throughout(model):
        one = ls.Engine(model, ls.ExecConfig(chunk_size=6))
        eos = int(one.generate(prompt, num_samples=1, max_new_tokens=3, temperature=0,
                               prompt_inputs=inputs).responses[0][-1])  # a turn ends at the third token
        kw = dict(num_samples=2, max_new_tokens=8, temperature=0, eos_token_id=eos, environment=_observation,
                  max_turns=1, prompt_inputs=inputs)
        want = one.generate(prompt, **kw)
        got = ls.Engine(model, ls.ExecConfig(context_parallel=True, chunk_size=6, shard_block_size=3)).generate(
            prompt, **kw)
    assert got.turns == want.turns and sum(got.turns) > 0, (got.turns, want.turns)
    for a, b, la, lb, ma, mb in zip(got.responses, want.responses, got.logprobs, want.logprobs, got.loss_masks,
                                    want.loss_masks):
        assert torch.equal(a, b) and torch.equal(ma, mb), (a, b)
        assert (la - lb).abs().max() <= FLOAT64, (la, lb)


def run_cases_then_images(rank: int, world: int, init_file: str, cases: list[str], modes: list[str]) -> None:
    """`distributed_worker.run_cases`, then `run_images`, in the same processes: one spawn
    for both (starting W ranks costs ~15 s on a loaded 2-core machine, the images' steps
    ~4 s). W = 3 runs the divided exact step alone (a rank dealt no image: zero tower
    partials), the costlier W's share of the default suite kept small."""
    run_cases(rank, world, init_file, cases, modes)
    run_images(rank, world, init_file + ".images", *(() if world == 2 else ([CONFIGS[1]], False)))
