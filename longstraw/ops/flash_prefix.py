"""The fused attention backward over one prefix segment, block by block, as one
registered op: `longstraw::flash_prefix_backward`.

`flash.FlashAttention.backward` walks each prefix segment (the captured prompt state:
S positions) in blocks of `BACKWARD_BLOCK` positions, calling torch's fused flash
backward once per block with the merged (dO, o, LSE) of the whole attention (the
ring-attention identity, see `flash.py`). At S = 2M that is 256 calls per layer per
branch piece, each a handful of ops: a Python loop that anything watching ops (fake
tensors in `ls.rehearse`, the live-byte tracker) pays for per op. As one registered op
it is one call per segment; its real implementation is the same loop (`prefix_backward`),
so the numbers are the loop's, bit for bit (tests/ops/test_flash_prefix.py).

    longstraw::flash_prefix_backward(do_rows, rows, k, v, out_rows, lse_rows, dq(a!),
                                     dk_sink(b!)?, dv_sink(c!)?, scale, block) -> ()

Shapes: do_rows, rows, out_rows [1, Hkv, M, D] (M = g*T query rows per kv head, in the
queries' dtype), lse_rows [1, Hkv, M]; k, v [Hkv, S, D] (views of the state); dq
[H, T, D] (accumulation dtype), added into in place; the sinks [Hkv, S, D] (exact mode's
gradient buffers of the state, float32), added into in place, or None.

The block's temporaries (its K and V copies, their dK, dV and the queries' dq of the
block; the planner's `plan.working.flash_backward_bytes`) live inside the op: they are
declared as its workspace (`ops/workspace.py`), so the tracker still counts them.
"""

from __future__ import annotations

import torch

from .workspace import declare_workspace

Tensor = torch.Tensor


def _flash_backward(do, q, k, v, out, lse, scale: float):
    """torch's fused CPU flash backward of a non-causal part -> (dq, dk, dv) [1, Hkv, ., D]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, False,
                                                                               scale=scale)


def prefix_backward(do_rows: Tensor, rows: Tensor, k: Tensor, v: Tensor, out_rows: Tensor, lse_rows: Tensor,
                    dq: Tensor, dk_sink: Tensor | None, dv_sink: Tensor | None, scale: float, block: int) -> None:
    """The plain loop (the op's real implementation): per block of `block` positions of
    k, v, the flash backward; its dq added into dq [H, T, D], its dk, dv into the sinks."""
    h, t, d = dq.shape
    for b0 in range(0, k.shape[1], block):
        b1 = min(k.shape[1], b0 + block)
        kb, vb = k[:, b0:b1].contiguous(), v[:, b0:b1].contiguous()
        dq_b, dk_b, dv_b = _flash_backward(do_rows, rows, kb[None], vb[None], out_rows, lse_rows, scale)
        dq += dq_b[0].reshape(h, t, d)
        if dk_sink is not None:
            dk_sink[:, b0:b1] += dk_b[0].to(dk_sink.dtype)
            dv_sink[:, b0:b1] += dv_b[0].to(dv_sink.dtype)
        del kb, vb, dq_b, dk_b, dv_b  # before the next block's: one block's copies at a time


@torch.library.custom_op("longstraw::flash_prefix_backward", mutates_args=("dq", "dk_sink", "dv_sink"))
def flash_prefix_backward(do_rows: Tensor, rows: Tensor, k: Tensor, v: Tensor, out_rows: Tensor, lse_rows: Tensor,
                          dq: Tensor, dk_sink: Tensor | None, dv_sink: Tensor | None, scale: float,
                          block: int) -> None:
    prefix_backward(do_rows, rows, k, v, out_rows, lse_rows, dq, dk_sink, dv_sink, scale, block)


@flash_prefix_backward.register_fake
def _(do_rows, rows, k, v, out_rows, lse_rows, dq, dk_sink, dv_sink, scale, block):
    return None


def workspace_bytes(do_rows, rows, k, v, out_rows, lse_rows, dq, dk_sink, dv_sink, scale, block) -> int:
    """The most bytes `prefix_backward` holds at once: one block's K and V copies (none
    where the block's view is already contiguous), the flash backward's dq, dk, dv of the
    block (in the queries' dtype), and a sink-dtype copy of dk while it is added."""
    if k.shape[1] == 0:
        return 0
    width = min(block, k.shape[1])
    kb, vb = k[:, :width], v[:, :width]
    copies = sum(0 if x.is_contiguous() else x.numel() * x.element_size() for x in (kb, vb))
    grads = (kb.numel() + vb.numel()) * rows.element_size() + rows.numel() * rows.element_size()
    cast = 0 if dk_sink is None or dk_sink.dtype == rows.dtype else kb.numel() * dk_sink.element_size()
    return copies + grads + cast


FLASH_PREFIX_BACKWARD = torch.ops.longstraw.flash_prefix_backward.default
declare_workspace(FLASH_PREFIX_BACKWARD, workspace_bytes)
