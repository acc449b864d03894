"""kvlab's CPU kernels (models/cpu_kernels.py, models/kv_cache/csrc/decode_linear.cpp): every dispatch path this CPU
runs gives the portable path's result within float32 rounding, every dtype sums in float32, the module's choice of
path by row count and dtype, the gradient path, the compiled path, and the mode's refusals."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import cpu_kernels
from models.kv_cache import kernels
from tests.helpers import run_py, untested_cases

REPO = Path(__file__).resolve().parents[2]
CASES = [
    ("kernels-mode-unknown", "`KVLAB_KERNELS=sse9 python run.py` (or harness.bench): `kvlab: KVLAB_KERNELS='sse9' "
                             "names no kernel path: use one of auto, avx512, avx2, portable, torch`, exit 2, before "
                             "any folder is made"),
    ("kernels-mode-unsupported", "`KVLAB_KERNELS=avx512` on a CPU without it: `KVLAB_KERNELS=avx512: this CPU lacks "
                                 "its instructions; it runs portable, avx2 (or auto, torch)`, exit 2"),
]
mod = kernels.load_linear()
pytestmark = pytest.mark.skipif(mod is None, reason="no C++ compiler: kvlab's linear kernels are not built")
EPS32 = 2.0 ** -24
HALVES = (torch.float16, torch.bfloat16)


def paths() -> list[str]:
    return [name for name, isa in cpu_kernels.ISAS.items() if mod is not None and mod.isa_supported(isa)]


def case(dtype, R, N=301, K=777, bias=True, seed=0):
    """x (R, K) float32 (so no output rounding hides a path's sums), w (N, K) and b in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def bound(x, w, b):
    """A rigorous bound on float32 summation's error for each output, in any order: K * eps * sum_k |x_k w_k|,
    plus the bias's addition."""
    absdot = x.abs().double() @ w.abs().double().t()
    if b is not None:
        absdot = absdot + b.abs().double()
    return (x.shape[-1] + 1) * EPS32 * absdot


def exact(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 6, 7, 8, 11, 17])
def test_every_path_gives_the_portable_result_within_float32_rounding(dtype, R):
    # N = 301 and K = 777 leave remainders for every tile of rows and every vector width
    x, w, b = case(dtype, R)
    portable = mod.linear(x, w, b, cpu_kernels.ISAS["portable"]).double()
    ref, tol = exact(x, w, b), bound(x, w, b)
    assert (portable - ref).abs().le(tol).all()  # the portable path itself sums in float32 (the half weights exact)
    for name in paths():
        y = mod.linear(x, w, b, cpu_kernels.ISAS[name]).double()
        assert y.shape == (R, 301)
        assert (y - portable).abs().le(2 * tol).all(), name
        assert (y - ref).abs().le(tol).all(), name


@pytest.mark.parametrize("shape", [(1, 1), (1, 16), (33, 64), (64, 15), (5, 4096)])
def test_every_path_handles_shapes_without_remainders_and_without_bias(shape):
    N, K = shape
    for R in (1, 8):
        x, w, b = case(torch.float32, R, N=N, K=K, bias=False, seed=N + K)
        for name in paths():
            y = mod.linear(x, w, b, cpu_kernels.ISAS[name]).double()
            assert (y - exact(x, w, b)).abs().le(bound(x, w, b)).all(), (name, shape, R)


@pytest.mark.parametrize("dtype", HALVES, ids=["fp16", "bf16"])
def test_a_half_precision_step_sums_in_float32_and_rounds_once(dtype):
    # x and w in the dtype: the result is the exact product of the stored values, rounded once to the dtype (up to
    # float32's sums), not a sum of products each rounded to the dtype
    x, w, b = case(dtype, 4)
    x = x.to(dtype)
    ref = exact(x.float(), w, b)
    got = cpu_kernels.linear(x.unsqueeze(1), w, b).squeeze(1)  # a decode step: one token for each of 4 sequences
    assert got.dtype == dtype
    once = ref.to(dtype).double()  # rounded once
    ulp = (ref.abs() * (2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7)).clamp_min(1e-30)
    assert ((got.double() - once).abs() <= ulp + bound(x.float(), w, b)).all()


@pytest.mark.parametrize("dtype", HALVES, ids=["fp16", "bf16"])
def test_every_path_writes_a_half_result_as_its_float32_result_rounded_to_nearest_even(dtype):
    # the kernel stores each float32 sum in x's dtype itself (no float32 y converted after): bit for bit what torch's
    # conversion of the float32 result gives, on every path, for rows of a step and of a batch
    for R in (1, 3, 8):
        x, w, b = case(dtype, R)
        x = x.to(dtype)
        for name in paths():
            isa = cpu_kernels.ISAS[name]
            got = mod.linear(x, w, b, isa)
            assert got.dtype == dtype
            assert torch.equal(got, mod.linear(x.float(), w, b, isa).to(dtype)), (name, R)


def test_the_path_follows_rows_dtype_and_gradient(monkeypatch):
    calls = []
    real = mod.linear

    class Spy:
        def __getattr__(self, name):
            return getattr(mod, name)

        def linear(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    lin = cpu_kernels.Linear(64, 32)
    monkeypatch.setattr(kernels, "load_linear", lambda: Spy())
    with cpu_kernels.use("auto"), torch.no_grad():
        lin(torch.randn(1, 1, 64))
        lin(torch.randn(8, 1, 64))
        lin(torch.randn(19, 1, 64))
        assert len(calls) == 3  # a decode step (one token per sequence), whatever the batch: the kernel
        lin(torch.randn(1, 2, 64))
        assert len(calls) == 3  # a prefill's: torch's GEMM
        lin.double()(torch.randn(1, 1, 64, dtype=torch.float64))
        assert len(calls) == 3  # a dtype the kernel does not read: torch's
        lin.float()
    with cpu_kernels.use("torch"), torch.no_grad():
        lin(torch.randn(1, 1, 64))
        assert len(calls) == 3
    with cpu_kernels.use("auto"):
        lin(torch.randn(1, 1, 64)).sum().backward()  # training: autograd's path, never the kernel
        assert len(calls) == 3 and lin.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=["fp32", "fp16", "bf16"])
def test_a_sequence_gets_the_same_outputs_alone_and_in_a_batch(dtype):
    torch.manual_seed(3)
    lin = cpu_kernels.Linear(200, 77).to(dtype)
    x = torch.randn(13, 1, 200).to(dtype)
    with torch.no_grad():
        together = lin(x)
        for b in range(13):
            assert torch.equal(lin(x[b:b + 1]), together[b:b + 1]), b  # bit for bit


def test_the_gradient_path_is_nn_linear_exactly():
    torch.manual_seed(0)
    ours, theirs = cpu_kernels.Linear(48, 24), nn.Linear(48, 24)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 48, requires_grad=True)
    ours(x).square().sum().backward()
    g_ours = (x.grad.clone(), ours.weight.grad.clone())
    x.grad = None
    theirs(x).square().sum().backward()
    assert torch.equal(g_ours[0], x.grad) and torch.equal(g_ours[1], theirs.weight.grad)


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=["fp32", "fp16", "bf16"])
def test_a_prefill_in_half_precision_sums_in_float32(dtype):
    torch.manual_seed(1)
    lin = cpu_kernels.Linear(96, 40).to(dtype)
    x = torch.randn(2, 12, 96).to(dtype)
    with torch.no_grad():
        got = lin(x)
    ref = exact(x.float().reshape(-1, 96), lin.weight.float(), lin.bias.float())
    tol = bound(x.float().reshape(-1, 96), lin.weight.float(), lin.bias.float())
    assert got.dtype == dtype and got.shape == (2, 12, 40)
    # rounded once from float32 sums: within half an ulp of the dtype (plus float32's own error) of the exact sum
    half_ulp = ref.abs() * {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    assert ((got.double().reshape(-1, 40) - ref).abs() <= half_ulp + tol + 1e-30).all()


@pytest.mark.slow  # seconds: not in make test-fast
def test_the_compiled_step_calls_the_kernel_as_an_operator():
    torch.manual_seed(2)
    lin = cpu_kernels.Linear(64, 48).eval()
    x = torch.randn(1, 1, 64)
    with torch.no_grad(), cpu_kernels.use("auto"):
        eager = lin(x)
        compiled = torch.compile(lin, fullgraph=True)(x)  # fullgraph: a graph break would raise
    assert torch.allclose(eager, compiled, atol=1e-6)


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


def test_a_mode_that_names_no_path_or_one_this_cpu_lacks_is_refused_in_one_line():  # kernels-mode-unsupported
    with pytest.raises(ValueError, match="names no kernel path: use one of auto, avx512, avx2, portable, torch"):
        cpu_kernels.set_mode("sse9")
    for name, isa in cpu_kernels.ISAS.items():
        if not mod.isa_supported(isa):
            with pytest.raises(ValueError, match=f"KVLAB_KERNELS={name}: this CPU lacks its instructions"):
                cpu_kernels.set_mode(name)
    assert "portable" in paths()  # every CPU runs the portable path
    with cpu_kernels.use("portable"):
        assert cpu_kernels.path() == "portable"
    with cpu_kernels.use("torch"):
        assert cpu_kernels.path() == "torch"
    with cpu_kernels.use("auto"):
        assert cpu_kernels.path() == mod.isa_name(mod.isa_best())


def test_the_read_bandwidth_probe_reads_every_float_once():
    buf = torch.arange(1 << 20, dtype=torch.float32) % 7
    assert mod.read_sum(buf) == buf.double().sum().item()  # every element read once, by every path's loads
    assert len(mod.read_gbps(buf, 3)) == 3


@pytest.mark.slow  # seconds: not in make test-fast
def test_a_build_killed_half_way_leaves_nothing_to_wait_on(tmp_path):
    # torch's own lock file stays behind when a build is killed (a test's SIGKILL, a cluster's preemption): the next
    # kvlab process takes the build up under its own lock instead of waiting for a lock nobody will release
    built = kernels.build_dir(kernels.LINEAR_NAME)
    assert built is not None and (built / f"{kernels.LINEAR_NAME}.so").exists()
    shutil.copytree(built, tmp_path / kernels.LINEAR_NAME)
    (tmp_path / kernels.LINEAR_NAME / "lock").touch()
    code = "from models.kv_cache.kernels import load_linear; print(load_linear().__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "KVLAB_KERNELS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tmp_path / kernels.LINEAR_NAME / f"{kernels.LINEAR_NAME}.so")
    assert not (tmp_path / kernels.LINEAR_NAME / "lock").exists()


def attention_case(dtype, B, nh, nkv, n, hs, seed=0):
    """q (B, nh, 1, hs); k, v the first n slots of a longer (B, nkv, n + 7, hs) store, as a pre-allocated cache holds
    them (rows contiguous, heads strided)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, 1, hs, generator=g).to(dtype)
    store = torch.randn(2, B, nkv, n + 7, hs, generator=g).mul(2).to(dtype)
    return q, store[0, :, :, :n], store[1, :, :, :n]


def attention_exact(q, k, v):
    groups = q.size(1) // k.size(1)
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    att = (q.double() @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
    return att.softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("B,nh,nkv,n,hs", [(1, 12, 12, 960, 64), (3, 8, 2, 37, 80), (2, 4, 1, 1, 16), (1, 2, 2, 5, 7)])
def test_every_path_of_decode_attention_gives_the_exact_result_within_float32_rounding(dtype, B, nh, nkv, n, hs):
    q, k, v = attention_case(dtype, B, nh, nkv, n, hs)
    ref = attention_exact(q, k, v)
    portable = None
    for name in paths():
        got = mod.attention(q.float(), k.float(), v.float(), cpu_kernels.ISAS[name]) if dtype == torch.float32 else \
            mod.attention(q, k, v, cpu_kernels.ISAS[name])
        assert got.shape == (B, nh, 1, hs) and got.dtype == dtype
        # float32 throughout, rounded once: within the dtype's half ulp of the exact result (of the stored values)
        half_ulp = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
        err = (got.double() - ref).abs()
        assert (err <= half_ulp * ref.abs() + 1e-5 * v.double().abs().max()).all(), name
        if name == "portable":
            portable = got
        else:
            assert (got.double() - portable.double()).abs().max() <= 2 * half_ulp * ref.abs().max() + 2e-5, name


def test_sdpa_takes_the_kernel_for_a_decode_step_only(monkeypatch):
    from models import attention

    calls = []
    real = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v = attention_case(torch.float32, 2, 4, 2, 30, 32)
    with cpu_kernels.use("auto"), torch.no_grad():
        y = attention.sdpa(q, k, v)
        assert calls == [1]
        theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert (y - theirs).abs().max() <= 1e-6
        mask = torch.ones(1, 30, dtype=torch.bool)
        attention.sdpa(q, k, v, mask)  # a mask: torch's SDPA
        assert calls == [1]
    with cpu_kernels.use("torch"):
        assert cpu_kernels.decode_attention(q, k, v) is None


def test_a_run_with_an_unknown_mode_is_refused_before_any_folder(tmp_path):  # kernels-mode-unknown
    out = run_py(["model=tiny", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, extra_env={"KVLAB_KERNELS": "sse9"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["kvlab: KVLAB_KERNELS='sse9' names no kernel path: use one of auto, "
                                               "avx512, avx2, portable, torch"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stored", HALVES, ids=["fp16", "bf16"])
def test_k_and_v_stored_in_half_precision_are_read_as_stored_under_float32_compute(stored, monkeypatch):
    # dtype=fp16 on a CPU: fp32 weights and activations, K/V stored in fp16; the kernel reads them where they lie
    q, k, v = attention_case(torch.float32, 2, 6, 3, 41, 64)
    k, v = k.to(stored), v.to(stored)
    ref = attention_exact(q, k.float(), v.float())
    for name in paths():
        got = mod.attention(q, k, v, cpu_kernels.ISAS[name])
        assert got.dtype == torch.float32
        assert (got.double() - ref).abs().max() <= 1e-5 * v.double().abs().max(), name
    # through a decode step's attention: no float32 copy of the history is made
    from models import attention

    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: copies.append(t.shape) or real_to(t, *a, **kw))

    class Stored:  # what attend asks of a cache: the kind stores the step, returns every key as stored
        evicts, fused, pos = False, False, 40

        def update(self, layer, k_new, v_new):
            return k, v

    with cpu_kernels.use("auto"), torch.no_grad():
        y = attention.attend(q, k[:, :, -1:].float(), v[:, :, -1:].float(), Stored(), 0)
    assert (y.double() - ref).abs().max() <= 1e-5 * v.double().abs().max()
    assert all(shape[2] != 41 for shape in copies if len(shape) == 4), copies  # the history was not converted
