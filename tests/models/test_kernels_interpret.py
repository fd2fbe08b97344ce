"""Whole-model GRPO steps with fla's real Triton kernels (Triton's interpreter, CPU,
float32) equal the same steps on the torch path: a tiny Qwen3.5 (GDN, grouped heads),
a tiny Kimi Linear (KDA) and a tiny Bamba (Mamba2's SSD as fla's `chunk_simple_gla`,
and as mamba-ssm's `mamba_chunk_scan_combined` when mamba-ssm is installed).

Opt in: `python -m pytest -q -m interpret` with the `kernels` extra installed. Each
test asserts which kernels the engine really picked (and how often), then compares
the loss and every parameter's .grad. Greedy decoding (the fused-recurrent decode
kernels inside `engine.generate`) must give the same tokens and log-probs.

Tolerance: n * u (u = 2^-24, n = (P + R) * (Dk + Dv), the op tests' rule at the
longest sequence a kernel sees), as torch.testing does it: rtol = n * u on each
parameter's gradient norm, plus atol = n * u times the whole model's gradient norm.
The atol matters for fla's decay gradient (dt_bias, A_log, the gate projections):
fla forms dg from reverse cumulative sums of q.dq - k.dk, a difference of terms the
size of the large gradients, so its float32 error is absolute (~1e-6 of them), not
relative to the small result (measured: ~1e-3 relative on Qwen3.5's first-layer
dt_bias at |g| 6e-3, against 6e-5 for the torch path; both ~5e-7 of the whole norm).
Times and errors go to bench/results/interpret_models.csv.
"""

from __future__ import annotations

import tests.ops.interpret as interpret  # first: sets TRITON_INTERPRET=1 before triton / fla load

import collections
import os
import time
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.ops import kernels
from tests.ops.test_kernels_interpret import write_rows
from tests.reference import grads_of, random_group, tiny_hybrid, tiny_kimi, tiny_mamba

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(not interpret.available(), reason="needs the kernels extra (fla-core, triton)")]

U32 = torch.finfo(torch.float32).eps / 2
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "interpret_models.csv"
P, R = 9, (3, 2)  # prompt and response lengths: small, the interpreter runs every program in Python
_rows: list[dict] = []

# family -> (builder, (Dk, Dv) of its recurrent mixer, the kernel its steps use, its decode kernel)
MODELS = {
    "qwen3_5": (lambda: tiny_hybrid("qwen3_5", dtype=torch.float32, linear_key_head_dim=16, linear_value_head_dim=16),
                (16, 16), "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "kimi_linear": (lambda: tiny_kimi(dtype=torch.float32, linear_head_dim=16), (16, 16), "chunk_kda",
                    "fused_recurrent_kda"),
    # 4 heads over 2 groups of B / C, so that the heads' grouping shows
    "bamba": (lambda: tiny_mamba("bamba", dtype=torch.float32, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2,
                                 mamba_d_state=16), (16, 16), "chunk_simple_gla", None),  # decode: torch's ssd_step
}


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    interpret.install()
    kernels.load.cache_clear()
    yield
    kernels.load.cache_clear()
    if _rows and os.environ.get("LONGSTRAW_INTERPRET_CSV", "1") == "1":
        write_rows(RESULTS, _rows, ("family", "mode", "kernel"))


@pytest.fixture
def picked(monkeypatch):
    """Counter of the kernels `kernels.pick` handed out (not None) in this test."""
    counts = collections.Counter()
    pick = kernels.pick

    def spy(name, *tensors):
        kernel = pick(name, *tensors)
        if kernel is not None:
            counts[name] += 1
        return kernel
    monkeypatch.setattr(kernels, "pick", spy)
    return counts


def _group():
    """Off-policy (old log-probs given) with a KL term, so that the loss depends on the log-probs."""
    group = random_group(97, P, list(R), seed=1)
    gen = torch.Generator().manual_seed(3)
    near = lambda r: -4.6 + 0.1 * torch.randn(len(r), generator=gen, dtype=torch.float64)  # noqa: E731  ~ log(1/97)
    group.old_logprobs = [near(r) for r in group.responses]
    group.ref_logprobs = [near(r) for r in group.responses]
    return group


def _step(model, mode, forced: bool):
    model.zero_grad(set_to_none=True)
    engine = ls.Engine(model, ls.ExecConfig(mode=mode, chunk_size=4))
    start = time.perf_counter()
    if forced:
        with kernels.forced():
            result = engine.step(_group(), ls.GRPOConfig(loss_type="dapo", beta=0.1))
    else:
        result = engine.step(_group(), ls.GRPOConfig(loss_type="dapo", beta=0.1))
    return result.loss, grads_of(model), time.perf_counter() - start


@pytest.fixture
def without_mamba_ssm(monkeypatch):
    """`kernels.load` as if mamba-ssm were not installed (Mamba2 then takes fla's chunk_simple_gla)."""
    load = kernels.load
    monkeypatch.setattr(kernels, "load", lambda name: None if name == "mamba_chunk_scan_combined" else load(name))


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_step_with_kernels_equals_torch_path(family, mode, picked, without_mamba_ssm):
    _check_step(family, mode, picked, MODELS[family][2])


@pytest.mark.skipif(not interpret.mamba_available(), reason="needs mamba-ssm (MAMBA_SKIP_CUDA_BUILD=TRUE, docs/gpu.md)")
def test_mamba2_exact_step_with_mamba_ssm_equals_torch_path(picked):
    """Exact mode only (it runs capture, replay and the walk; the interpreter is slowest on mamba-ssm)."""
    _check_step("bamba", "exact", picked, "mamba_chunk_scan_combined")


def _check_step(family, mode, picked, kernel):
    build, (dk, dv), _, _ = MODELS[family]
    model = build()
    loss0, grads0, sec0 = _step(model, mode, forced=False)
    assert not picked  # outside forced(): the torch path on CPU
    loss1, grads1, sec1 = _step(model, mode, forced=True)
    assert set(picked) == {kernel} and picked[kernel] >= 3 * 2  # every recurrent layer, capture and replay

    tol = (P + max(R)) * (dk + dv) * U32
    total = torch.cat([g.flatten() for g in grads0.values() if g is not None]).norm().item()
    assert abs(loss1 - loss0) <= tol * abs(loss0), (loss1, loss0)
    worst, bad = 0.0, []
    for name, g0 in grads0.items():
        g1 = grads1[name]
        if g0 is None:
            assert g1 is None, name
            continue
        err, norm = (g1 - g0).norm().item(), g0.norm().item()
        worst = max(worst, err / total)
        if not err <= tol * norm + tol * total:
            bad.append(f"{name}: |diff| {err:.2e}, |grad| {norm:.2e}, |all grads| {total:.2e}")
    _rows.append(dict(family=family, mode=mode, kernel=kernel, calls=picked[kernel], P=P, R=list(R),
                      loss_rel_err=f"{abs(loss1 - loss0) / abs(loss0):.2e}", grad_err_of_total=f"{worst:.2e}",
                      tol=f"{tol:.2e}", torch_s=f"{sec0:.2f}", kernels_s=f"{sec1:.2f}"))
    print(f"{family} {mode}: {picked[kernel]} x {kernel}, loss rel err {abs(loss1 - loss0) / abs(loss0):.1e}, "
          f"worst grad err / |all grads| {worst:.1e}, tol {tol:.1e}; {sec0:.1f}s torch, {sec1:.1f}s kernels")
    assert not bad, bad


@pytest.mark.parametrize("family", [f for f, spec in MODELS.items() if spec[3]])
def test_greedy_generate_with_decode_kernels_equals_torch_path(family, picked):
    build, (dk, dv), kernel, decode = MODELS[family]
    model = build()
    prompt = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(4))
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=2))
    with torch.no_grad():
        want = engine.generate(prompt, num_samples=2, max_new_tokens=4, temperature=0)
        assert not picked
        with kernels.forced():
            got = engine.generate(prompt, num_samples=2, max_new_tokens=4, temperature=0)
    assert picked[decode] >= 3 and picked[kernel] >= 1  # decode steps per recurrent layer; capture
    assert [r.tolist() for r in got.responses] == [r.tolist() for r in want.responses]
    tol = (len(prompt) + 4) * (dk + dv) * U32
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
