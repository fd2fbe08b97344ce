"""fla's real Triton kernels, run on CPU under Triton's interpreter through LongStraw's
own dispatch (`ops/kernels.py`, opened by `kernels.forced()`) and its callers
(`gated_delta.py`, `kda.py`, `ssd.py`), against the torch path.

Opt in: `pip install -e .[kernels] && python -m pytest -q -m interpret` (the `interpret`
marker is off by default); mamba-ssm's SSD also runs when mamba-ssm is installed
without its CUDA extensions (docs/gpu.md), and is skipped otherwise. Nothing here is faked: each test asserts that the named
kernel was really picked, then compares, in float32 on small shapes,

* outputs and final states, and
* the gradients of every input, the initial state's included, under random upstream
  gradients into both the output and the final state (fla's own test recipe),

with the torch path run in float64 on the same values (the reference; its own float32
error is recorded next to the kernel's). Each run's shapes, max error and time go to
bench/results/interpret_kernels.csv.

Tolerance, one rule for every tensor: |kernel - reference| <= tol * max|reference| with
tol = n * eps32, n = T * (Dk + Dv) the number of terms that can reach one output element
(T tokens, each through a Dk- and a Dv-long reduction), eps32 = 2^-23 / 2: the
worst-case bound on a float32 sum of n terms (Higham, |error| <= n u sum|terms|), taken
relative to the tensor's largest element. At the shapes here tol is 1e-6 to 1e-4; a
layout mistake (g and beta swapped, heads tiled instead of interleaved) gives O(1).
"""

from __future__ import annotations

import tests.ops.interpret as interpret  # first: sets TRITON_INTERPRET=1 before triton / fla load

import csv
import os
import time
from pathlib import Path

import pytest
import torch

from longstraw.ops import kernels
from longstraw.ops.gated_delta import chunk_gated_delta_rule, gated_delta_step
from longstraw.ops.kda import chunk_kda, kda_step
from longstraw.ops.ssd import chunk_ssd_scan

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(not interpret.available(), reason="needs the kernels extra (fla-core, triton)")]

F32, F64 = torch.float32, torch.float64
EPS32 = torch.finfo(F32).eps / 2  # unit roundoff u = 2^-24
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "interpret_kernels.csv"
KEY = ("kernel", "caller", "shapes", "tensor")  # a row of this run replaces the file's row of the same key
_rows: list[dict] = []


def write_rows(path: Path, rows: list[dict], key: tuple) -> None:
    """Merge `rows` into the CSV at `path`: this run's rows replace the old ones with the
    same key, the others stay (a `-k` subset does not drop the rest)."""
    old = list(csv.DictReader(path.open())) if path.exists() else []
    new = {tuple(r[k] for k in key) for r in rows}
    merged = [r for r in old if tuple(r[k] for k in key) not in new and set(r) == set(rows[0])] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(merged)


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    interpret.install()
    kernels.load.cache_clear()
    yield
    kernels.load.cache_clear()
    if _rows and os.environ.get("LONGSTRAW_INTERPRET_CSV", "1") == "1":
        write_rows(RESULTS, _rows, KEY)


@pytest.fixture
def picked(monkeypatch):
    """The names of the kernels `kernels.pick` handed out (not None) in this test."""
    names = []
    pick = kernels.pick

    def spy(name, *tensors):
        kernel = pick(name, *tensors)
        if kernel is not None:
            names.append(name)
        return kernel
    monkeypatch.setattr(kernels, "pick", spy)
    return names


def tolerance(t: int, dk: int, dv: int) -> float:
    """n * u with n = T * (Dk + Dv): see the module docstring."""
    return t * (dk + dv) * EPS32


def compare(kernel, caller, shapes, names, got, want, fp32, tol, seconds):
    """Assert got (kernel, float32) ~ want (torch path, float64) tensor by tensor; record rows."""
    assert len(got) == len(want) == len(names)
    bad = []
    for name, g, w, f in zip(names, got, want, fp32):
        scale = w.abs().max().item() or 1.0
        err = (g.to(F64) - w).abs().max().item()
        ref_err = (f.to(F64) - w).abs().max().item()
        _rows.append(dict(kernel=kernel, caller=caller, shapes=shapes, tensor=name, max_abs_err=f"{err:.3e}",
                          max_rel_err=f"{err / scale:.3e}", torch_fp32_rel_err=f"{ref_err / scale:.3e}",
                          tol=f"{tol:.3e}", time_s=f"{seconds:.2f}"))
        print(f"{kernel:34s} {shapes:38s} {name:8s} rel err {err / scale:.2e} (torch fp32 {ref_err / scale:.2e}, "
              f"tol {tol:.1e}) {seconds:.1f}s")
        if not err <= tol * scale:
            bad.append(f"{name}: rel err {err / scale:.3e} > tol {tol:.3e}")
    assert not bad, f"{kernel} ({shapes}): " + "; ".join(bad)


def run_both(fn, leaves, *, grad: bool, seed: int = 7):
    """fn on float32 leaves (kernels forced), the same fn on float64 copies (torch path:
    float64 is never dispatched) and on float32 with allow_kernel=False. Returns
    (got, want, fp32, seconds): outputs, then input gradients when `grad`."""
    l32 = [x.detach().to(F32).requires_grad_(grad) for x in leaves]
    l64 = [x.detach().to(F64).requires_grad_(grad) for x in leaves]
    lref = [x.detach().to(F32).requires_grad_(grad) for x in leaves]
    start = time.perf_counter()
    with kernels.forced():
        outs32 = fn(*l32, allow_kernel=True)
    outs64, outs_ref = fn(*l64, allow_kernel=False), fn(*lref, allow_kernel=False)
    if not grad:
        return list(outs32), list(outs64), list(outs_ref), time.perf_counter() - start
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs64]  # into the output and the final state
    g32 = torch.autograd.grad(outs32, l32, [u.to(F32) for u in ups])
    seconds = time.perf_counter() - start
    g64 = torch.autograd.grad(outs64, l64, ups)
    gref = torch.autograd.grad(outs_ref, lref, [u.to(F32) for u in ups])
    return [*outs32, *g32], [*outs64, *g64], [*outs_ref, *gref], seconds


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


# ----------------------------------------------------------------------------
# Gated DeltaNet: chunk (grouped heads), decode


@pytest.mark.parametrize("t", [1, 37, 130])
def test_chunk_gated_delta_rule_grouped_heads(t, picked):
    hk, hv, dk, dv = 2, 4, 16, 32  # value heads > key heads: fla groups them itself
    gen = torch.Generator().manual_seed(t)
    q, k, v = _rand(gen, t, hk, dk), _rand(gen, t, hk, dk), _rand(gen, t, hv, dv)
    g = -torch.rand(t, hv, generator=gen, dtype=F64) * 0.5 - 0.01  # log decay < 0
    beta = torch.rand(t, hv, generator=gen, dtype=F64)
    h0 = _rand(gen, hv, dk, dv) * 0.5
    got, want, fp32, sec = run_both(chunk_gated_delta_rule, [q, k, v, g, beta, h0], grad=True)
    assert picked == ["chunk_gated_delta_rule"]
    compare("fla chunk_gated_delta_rule", "gated_delta.chunk_gated_delta_rule",
            f"T={t} Hk={hk} Hv={hv} Dk={dk} Dv={dv}", ["out", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"],
            got, want, fp32, tolerance(t, dk, dv), sec)


def test_gated_delta_step_decode(picked):
    b, hk, hv, dk, dv = 3, 2, 4, 16, 32
    gen = torch.Generator().manual_seed(11)
    q, k, v = _rand(gen, b, hk, dk), _rand(gen, b, hk, dk), _rand(gen, b, hv, dv)
    g = -torch.rand(b, hv, generator=gen, dtype=F64) - 0.01
    beta, state = torch.rand(b, hv, generator=gen, dtype=F64), _rand(gen, b, hv, dk, dv)
    with torch.no_grad():
        got, want, fp32, sec = run_both(gated_delta_step, [q, k, v, g, beta, state], grad=False)
    assert picked == ["fused_recurrent_gated_delta_rule"]
    compare("fla fused_recurrent_gated_delta_rule", "gated_delta.gated_delta_step",
            f"B={b} Hk={hk} Hv={hv} Dk={dk} Dv={dv}", ["out", "state"], got, want, fp32, tolerance(1, dk, dv), sec)


# ----------------------------------------------------------------------------
# KDA: chunk, decode


@pytest.mark.parametrize("t", [1, 37, 130])
def test_chunk_kda(t, picked):
    h, dk, dv = 2, 16, 32
    gen = torch.Generator().manual_seed(100 + t)
    q, k, v = _rand(gen, t, h, dk), _rand(gen, t, h, dk), _rand(gen, t, h, dv)
    g = -torch.rand(t, h, dk, generator=gen, dtype=F64) * 0.5 - 0.01  # per-channel log decay
    beta = torch.rand(t, h, generator=gen, dtype=F64)
    h0 = _rand(gen, h, dk, dv) * 0.5
    got, want, fp32, sec = run_both(chunk_kda, [q, k, v, g, beta, h0], grad=True)
    assert picked == ["chunk_kda"]
    compare("fla chunk_kda", "kda.chunk_kda", f"T={t} H={h} Dk={dk} Dv={dv}",
            ["out", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, want, fp32, tolerance(t, dk, dv), sec)


def test_kda_step_decode(picked):
    b, h, dk, dv = 3, 2, 16, 32
    gen = torch.Generator().manual_seed(12)
    q, k, v = _rand(gen, b, h, dk), _rand(gen, b, h, dk), _rand(gen, b, h, dv)
    g = -torch.rand(b, h, dk, generator=gen, dtype=F64) - 0.01
    beta, state = torch.rand(b, h, generator=gen, dtype=F64), _rand(gen, b, h, dk, dv)
    with torch.no_grad():
        got, want, fp32, sec = run_both(kda_step, [q, k, v, g, beta, state], grad=False)
    assert picked == ["fused_recurrent_kda"]
    compare("fla fused_recurrent_kda", "kda.kda_step", f"B={b} H={h} Dk={dk} Dv={dv}", ["out", "state"],
            got, want, fp32, tolerance(1, dk, dv), sec)


# ----------------------------------------------------------------------------
# Mamba2's SSD: mamba-ssm's mamba_chunk_scan_combined (picked first), fla's chunk_simple_gla


@pytest.fixture
def without_mamba_ssm(monkeypatch):
    """`kernels.load` as if mamba-ssm were not installed (ssd_chunk then takes fla's kernel)."""
    load = kernels.load
    monkeypatch.setattr(kernels, "load", lambda name: None if name == "mamba_chunk_scan_combined" else load(name))


def _ssd_case(t, label, chunk):
    h, p, g_, n = 4, 16, 2, 16  # 2 groups of B / C for 4 heads
    gen = torch.Generator().manual_seed(200 + t)
    x, b, c = _rand(gen, t, h, p), _rand(gen, t, g_, n), _rand(gen, t, g_, n)
    dt = torch.rand(t, h, generator=gen, dtype=F64) * 0.5 + 0.05
    a = -torch.rand(h, generator=gen, dtype=F64) - 0.2
    h0 = _rand(gen, h, p, n) * 0.5

    def scan(*xs, allow_kernel):
        return chunk_ssd_scan(*xs, chunk_size=chunk, allow_kernel=allow_kernel)
    got, want, fp32, sec = run_both(scan, [x, dt, a, b, c, h0], grad=True)
    compare(label, "ssd.chunk_ssd_scan", f"T={t} H={h} P={p} G={g_} N={n}" + (f" chunk={chunk}" if chunk else ""),
            ["y", "state", "dx", "ddt", "dA", "dB", "dC", "dh0"], got, want, fp32, tolerance(t, n, p), sec)


@pytest.mark.parametrize("t", [1, 37, 130])
def test_ssd_through_chunk_simple_gla(t, picked, without_mamba_ssm):
    _ssd_case(t, "fla chunk_simple_gla (SSD)", 16)
    assert picked == ["chunk_simple_gla"]


@pytest.mark.skipif(not interpret.mamba_available(), reason="needs mamba-ssm (MAMBA_SKIP_CUDA_BUILD=TRUE, docs/gpu.md)")
@pytest.mark.parametrize("t", [1, 37, 130])
def test_ssd_through_mamba_chunk_scan_combined(t, picked):
    _ssd_case(t, "mamba-ssm mamba_chunk_scan_combined", 16)
    assert picked == ["mamba_chunk_scan_combined"]
