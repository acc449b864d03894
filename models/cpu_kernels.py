"""kvlab's own CPU kernels for a decode step (``models/kv_cache/csrc/decode_linear.cpp``), and which path runs.

``Linear`` is an ``nn.Linear`` (the same parameters, names, init and state dict) whose forward is ``linear``, the one
function every projection of kvlab's decoders runs through; ``decode_attention`` is the attention of a decode step
over dense K/V (``models.attention.sdpa`` calls it for one query per sequence and no mask).

At inference on the CPU (no gradient asked), x and the weight both float32, float16 or bfloat16:
- **one token per sequence** (x of shape (..., 1, in): a decode step, any batch) runs kvlab's own kernel
  (``models/kv_cache/csrc/decode_linear.cpp``): the weight read once, in nn.Linear's (out, in) layout, converted to
  float32 as it is read, the products summed in float32, the bias added in float32, the result rounded once to the
  dtype. fp16 and bf16 steps thus sum in float32 as GPUs and llama.cpp do: their drift from fp32 measures the storage
  of weights, activations and K/V in half precision and the rounding of each layer's inputs and outputs, not a
  low-precision sum;
- **more tokens per sequence in float16 or bfloat16** (a prefill) run torch's float32 matrix product on float32 copies of x, the
  weight and the bias, rounded once to the dtype: the same float32 sums, at float32's speed (torch's own
  half-precision product is many times slower on CPUs without AVX512-FP16);
- more tokens per sequence in float32 run torch's (``F.linear``), and so does everything else (training, a GPU).

The path depends on the tokens per sequence, never on the batch: a sequence's outputs are the same passed alone or
beside others (the kernel computes each row alone, in the same order, whatever the rows beside it).

A decode step's attention (one query per sequence, every cached key visible, each K/V row contiguous; K/V in any of
the three dtypes, read where the cache stores them: fp16 K/V under fp32 compute are never copied to fp32) runs the
kernel too: scores, softmax and the weighted sum of V in float32, each query head reading its
group's K/V head where the cache holds it (no copy per query head), the result rounded once to the dtype; torch's
SDPA runs everything else (a prefill, a mask, an evicting kind's scored attention, a compiled step).

Which path a decode step takes is ``path()``; every run's environment fingerprint records it (``cpu_kernels``).
``KVLAB_KERNELS`` in the environment, or ``use(mode)`` / ``set_mode(mode)``, picks it:

    auto                       the widest instruction set this CPU has (the default): avx512, avx2 or portable
    avx512 | avx2 | portable   that kernel (refused in one line where this CPU lacks its instructions)
    torch                      torch's F.linear and SDPA for everything: kvlab before its kernels
"""

import contextlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


MODES = ("auto", "avx512", "avx2", "portable", "torch")
ISAS = {"portable": 0, "avx2": 1, "avx512": 2}  # the kernel's own numbering (csrc/decode_linear.cpp's Isa)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_state = {"mode": None, "isa": None}  # the mode asked, and the kernel path it resolved to (None: torch's)


def _module():
    """The built kernel module (None: no C++ compiler); imported here, not above: models.kv_cache's kinds import
    models.attention, which imports this module."""
    from models.kv_cache import kernels

    return kernels.load_linear()


def check_mode(mode: str) -> str:
    """``mode`` if it names a path (``MODES``) this machine runs, else a one-line ValueError."""
    if mode not in MODES:
        raise ValueError(f"KVLAB_KERNELS={mode!r} names no kernel path: use one of {', '.join(MODES)}")
    if mode in ISAS:
        mod = _module()
        if mod is None:
            raise ValueError(f"KVLAB_KERNELS={mode}: kvlab's CPU kernels are not built here (no C++ compiler): use "
                             "auto or torch")
        if not mod.isa_supported(ISAS[mode]):
            best = [n for n, i in ISAS.items() if mod.isa_supported(i)]
            raise ValueError(f"KVLAB_KERNELS={mode}: this CPU lacks its instructions; it runs {', '.join(best)} "
                             "(or auto, torch)")
    return mode


def set_mode(mode: str) -> None:
    """Choose the path of every later ``linear`` call (``MODES``); refused in one line where it cannot run here."""
    check_mode(mode)
    isa = None
    if mode in ISAS:
        isa = ISAS[mode]
    elif mode == "auto":
        mod = _module()
        isa = None if mod is None else int(mod.isa_best())
    _state.update(mode=mode, isa=isa)


@contextlib.contextmanager
def use(mode: str):
    """``set_mode(mode)`` within the block, the mode before it restored after."""
    before = mode_now()
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(before)


def mode_now() -> str:
    if _state["mode"] is None:
        set_mode(os.environ.get("KVLAB_KERNELS", "auto"))
    return _state["mode"]


def path() -> str:
    """The path a decode step takes now: avx512, avx2, portable (kvlab's kernels) or torch."""
    mode_now()
    isa = _state["isa"]
    return "torch" if isa is None else next(n for n, i in ISAS.items() if i == isa)


@torch.library.custom_op("kvlab::linear", mutates_args=(), schema="(Tensor x, Tensor w, Tensor? b, int isa) -> Tensor")
def _kernel_op(x, w, b, isa):
    return _module().linear(x, w, b, isa)


@_kernel_op.register_fake
def _(x, w, b, isa):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _inference(*tensors) -> bool:
    """Whether these tensors may take kvlab's kernels: on the CPU, of one dtype the kernels read, no gradient asked."""
    mode_now()
    dtype = tensors[0].dtype
    return (_state["mode"] != "torch" and dtype in DTYPES
            and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, by the path the module's docstring describes."""
    if not _inference(x, w, *([] if b is None else [b])):
        return F.linear(x, w, b)
    isa = _state["isa"]
    step = x.dim() >= 2 and x.shape[-2] == 1  # one token per sequence
    if isa is not None and step and w.is_contiguous():
        if torch.compiler.is_compiling():
            return torch.ops.kvlab.linear(x, w, b, isa)
        return _module().linear(x, w, b, isa)
    if w.dtype != torch.float32:  # a half-precision prefill: float32 sums at float32's speed, rounded once
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """A decode step's attention, q (B, nh, 1, hs) over every key of k, v (B, nkv, n, hs), through kvlab's kernel;
    None where it does not take that path (torch's SDPA then runs). K and V may be stored in another dtype than q's
    (fp16 K/V under fp32 compute): the kernel reads them as stored, with no float32 copy of the history."""
    if (q.dim() != 4 or q.size(2) != 1 or not (_inference(q) and _inference(k, v)) or _state["isa"] is None
            or k.size(2) == 0 or k.stride(-1) != 1 or v.stride(-1) != 1 or torch.compiler.is_compiling()):
        return None
    return _module().attention(q, k, v, _state["isa"])


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (kvlab's kernels at inference on the CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
