"""Triton's interpreter for the real fla kernels on CPU: import this module before
anything imports triton or fla (it sets TRITON_INTERPRET=1, which triton reads when
a kernel is decorated; `tests/conftest.py` imports it first under `-m interpret`),
then call `install()` once.

The interpreter runs each Triton program on numpy arrays, program by program. Two
things differ from compiled Triton in ways fla 0.6.0 (and mamba-ssm) hit; `install()`
patches them in memory (nothing on disk changes):

1. Autotuning keeps one config (`Autotuner.prune_configs` -> its first config).
   Reason: with several configs triton benchmarks each one through
   `triton.testing.do_bench`, which needs a GPU driver. fla wraps its kernels in its
   own `CachedAutotuner` (`fla.ops.utils.cache`), which bypasses `triton.autotune`
   but still calls `Autotuner.run` -> `prune_configs`, so this is the one seam that
   catches both. Under the interpreter every config computes the same numbers (block
   sizes only change the tiling; the dot is exact fp32 either way).
2. `range` / `tl.range` loop variables become tensors (int32 scalars).
   Reason: the interpreter runs a kernel's `for i in range(n)` as Python's `range`
   (and maps `tl.range` to it), so the loop variable is a Python int; compiled Triton
   makes it a tensor, and `fla/ops/common/chunk_delta_h.py` calls `i_t.to(tl.int64)`
   on one. The patch adds one step to the interpreter's source rewrite
   (`interpreter.ASTTransformer`): the loop body starts with
   `i = interpreter_semantic.to_tensor(i, False)`. `tl.static_range` keeps Python
   ints (compiled Triton unrolls it, its variable a constexpr).

mamba-ssm (2.3.2.post1, installed without its CUDA extensions: see docs/gpu.md) needs
three more stand-ins, all host-side Python, none inside a kernel:

3. A stub `selective_scan_cuda` module, only when the real one is missing. Reason:
   `import mamba_ssm` runs `mamba_ssm/__init__.py`, which imports the selective-scan
   interface, which does a bare `import selective_scan_cuda` (the Mamba1 CUDA
   extension). The Triton SSD (`mamba_ssm.ops.triton.ssd_combined`) never calls it.
4. `torch.cuda.device(None)` is a no-op. Reason: mamba-ssm wraps each launch in
   `with torch.cuda.device(x.device.index)`, and a CPU tensor's index is None.
5. `torch.cuda.get_device_properties(cpu)` answers `multi_processor_count=132` (an
   H100 / H200 SXM). Reason: mamba-ssm's backward (`_chunk_state_bwd_db`,
   `_chunk_scan_bwd_dC`, `_chunk_scan_bwd_dcb`) splits the heads of a group over
   ceil(batch * chunks * heads / SMs) programs and sums the splits after; with a GPU's
   count the small shapes here take the split path a GPU takes (1 would never split).
   Both 4 and 5 pass every CUDA device through to torch unchanged.

Known interpreter limits: no bf16 (numpy has none), and `tl.dot` is exact fp32, not
TF32, so fp32 results here are tighter than on a GPU.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
import types

# fla / mamba-ssm decorate their kernels when imported: compiled, for good, unless this is set first
_TOO_LATE = [m for m in ("triton", "fla", "mamba_ssm") if m in sys.modules] if os.environ.get(
    "TRITON_INTERPRET") != "1" else []
os.environ["TRITON_INTERPRET"] = "1"

_installed = False


def available() -> bool:
    """True when fla and triton import (the `kernels` extra is installed)."""
    try:
        import fla  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def mamba_available() -> bool:
    """True when mamba-ssm's Triton SSD imports (after `install()`'s stub extension)."""
    if not available():
        return False
    install()
    try:
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except ImportError:
        return False
    return True


def install() -> None:
    """Apply the patches (idempotent). Raises if triton was imported without the
    interpreter (then its kernels would try to compile for a GPU)."""
    global _installed
    if _installed:
        return
    import torch
    from triton import knobs
    from triton.runtime import autotuner, interpreter

    if _TOO_LATE or not knobs.runtime.interpret:
        raise RuntimeError(f"{', '.join(_TOO_LATE) or 'triton'} imported before TRITON_INTERPRET=1 was set: import "
                           "tests.ops.interpret first (tests/conftest.py does, under -m interpret)")

    # 1. one config: no benchmarking through the missing GPU driver
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    # 2. `for i in range(...)` / `tl.range(...)` loop variables become tensors
    def visit_for(self, node):
        node = self.generic_visit(node)
        call = node.iter
        name = getattr(call, "func", None)
        name = getattr(name, "attr", getattr(name, "id", None))
        if isinstance(call, ast.Call) and name == "range" and isinstance(node.target, ast.Name):
            to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                      ctx=ast.Load())
            wrap = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                              value=ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                                   ast.Constant(value=False)], keywords=[]))
            node.body.insert(0, ast.copy_location(wrap, node))
        return node

    interpreter.ASTTransformer.visit_For = visit_for

    # 3. mamba_ssm's package import needs its Mamba1 CUDA extension's name only
    if importlib.util.find_spec("selective_scan_cuda") is None:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")

    # 4. and 5. mamba-ssm's host code asks CUDA about the tensors' device
    cuda_device, properties = torch.cuda.device, torch.cuda.get_device_properties
    torch.cuda.device = lambda device: contextlib.nullcontext() if device is None else cuda_device(device)
    torch.cuda.get_device_properties = lambda device=None: (
        types.SimpleNamespace(multi_processor_count=132) if device is not None and torch.device(device).type == "cpu"
        else properties(device))
    _installed = True
