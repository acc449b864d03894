"""What a run measures, as pure functions: an engine and plain arguments in, plain dicts / DataFrames out.
No W&B, no files, no printing (a tqdm bar on stderr when ``progress`` is true is the one exception).

- ``generation_checks``: cached generation vs the uncached model (equivalence) and vs FP32 (drift), per step.
- ``step_times``: one decode step at each context length, cached and uncached, median and spread of repeats.
- ``time_to_first_token``: prefill of the prompt.
- ``cache_memory``: the cache's bytes against the formula, and the process's peak memory.
- ``fingerprint``: what the numbers were measured on.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from models.kv_cache import kv_bytes

REPO = Path(__file__).resolve().parent.parent


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return dict(ms_median=float(np.median(ms)), ms_p10=float(np.percentile(ms, 10)),
                ms_p90=float(np.percentile(ms, 90)), ms_min=float(ms.min()), repeats=len(ms))


# ---- equivalence and drift -----------------------------------------------------------------------------------

def logit_stats(test: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-step comparison of logits (n, vocab) against a reference (n, vocab), both read as float32."""
    test, ref = test.float(), ref.float()
    diff = (test - ref).abs()
    top2 = ref.topk(2, dim=-1).values  # (n, 2)
    return dict(
        max_abs=diff.amax(dim=-1),
        mean_abs=diff.mean(dim=-1),
        # in float64: near-identical distributions over 50k tokens otherwise round to small negative KLs
        kl=F.kl_div(test.double().log_softmax(-1), ref.double().log_softmax(-1), log_target=True,
                    reduction="none").sum(-1).clamp_min(0).float(),
        top1_agree=(test.argmax(-1) == ref.argmax(-1)).float(),
        ref_margin=top2[:, 0] - top2[:, 1],  # how close the reference's top-1 and top-2 were
    )


def teacher_forced(engine, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One uncached forward over prompt + generated tokens: the logits (n, vocab) each generated token was chosen
    from, as the full model computes them."""
    seq = torch.cat([prompt, tokens], dim=1)  # (1, T + n)
    T, n = prompt.shape[1], tokens.shape[1]
    return engine.forward(seq)[0, T - 1:T - 1 + n]


def _first_true(mask: torch.Tensor) -> int | None:
    idx = torch.nonzero(mask)
    return int(idx[0]) if len(idx) else None


def generation_checks(engine, prompts: list[torch.Tensor], new_tokens: int, layout: str, cache_dtype,
                      full_prompts: int, ref32=None, progress: bool = False) -> tuple[dict, pd.DataFrame]:
    """Generate greedily with the cache (``layout``, storage ``cache_dtype``) from every prompt and check it.

    Equivalence, against the uncached model in the same compute dtype: a teacher-forced check (one full forward
    over each generated sequence, compared at every step) for all prompts, and the true uncached loop (re-run the
    context every step) for the first ``full_prompts``.
    Drift, when ``ref32`` (an FP32 engine) is given: the same tokens through the FP32 model, uncached: max and mean
    |dlogit|, KL(fp32 || reduced), top-1 agreement, and FP32's own greedy tokens vs ours (match rate, first
    divergence). Returns a flat summary dict and a per-step DataFrame (aggregated over prompts).
    """
    per_step: dict[str, list[torch.Tensor]] = {}
    identical, first_diff, margin_at_diff = True, None, None
    full_identical, full_max = True, 0.0
    match_rates, divergences = [], []
    same_ref = ref32 is engine

    def keep(prefix, stats):
        for k, v in stats.items():
            per_step.setdefault(f"{prefix}_{k}", []).append(v.cpu())

    for i, prompt in enumerate(tqdm(prompts, desc=f"generate+check ({layout})", disable=not progress)):
        out = engine.greedy(prompt, new_tokens, layout=layout, cache_dtype=cache_dtype)
        if i == 0:
            sample = out.tokens[0].tolist()
        ref_logits = teacher_forced(engine, prompt, out.tokens)
        eq = logit_stats(out.logits[0], ref_logits)
        keep("eq", eq)
        wrong = _first_true(ref_logits.argmax(-1) != out.tokens[0])
        if i < full_prompts:  # the true uncached loop
            loop = engine.greedy(prompt, new_tokens, layout=None)
            agree = _first_true(loop.tokens[0] != out.tokens[0])
            n_ok = new_tokens if agree is None else agree + 1  # logits agree in meaning up to the first split
            full_max = max(full_max, (out.logits[0, :n_ok].float() - loop.logits[0, :n_ok].float()).abs().max().item())
            full_identical &= agree is None
            if agree is not None and (wrong is None or agree < wrong):
                wrong = agree
        if wrong is not None:
            identical = False
            if first_diff is None or wrong < first_diff:
                first_diff, margin_at_diff = wrong, float(eq["ref_margin"][wrong])
        if ref32 is not None:
            ref = ref_logits if same_ref else teacher_forced(ref32, prompt, out.tokens)
            keep("drift", logit_stats(out.logits[0], ref))
            want = ref32.greedy(prompt, new_tokens, layout="prealloc").tokens[0]  # FP32 greedy (cached == uncached)
            match_rates.append((want == out.tokens[0]).float().mean().item())
            divergences.append(_first_true(want != out.tokens[0]))

    steps = {k: torch.stack(v) for k, v in per_step.items()}  # (n_prompts, new_tokens) each
    table = pd.DataFrame({"step": np.arange(new_tokens),
                          "eq_max_abs_diff": steps["eq_max_abs"].amax(0).numpy(),
                          "eq_top1_agreement": steps["eq_top1_agree"].mean(0).numpy()})
    summary = dict(
        tokens_identical=identical,
        max_abs_logit_diff=max(float(steps["eq_max_abs"].max()), full_max),
        first_diff_step=first_diff,
        margin_at_first_diff=margin_at_diff,
        min_ref_margin=float(steps["eq_ref_margin"].min()),
        equivalence_method=f"teacher_forced({len(prompts)})+full_loop({full_prompts})",
        teacher_forced_prompts=len(prompts),
        full_loop_prompts=full_prompts,
        full_loop_tokens_identical=full_identical if full_prompts else None,
        sample_tokens=sample,  # what the first prompt generated
    )
    drift_keys = ("drift_max_abs", "drift_mean_abs", "drift_kl", "drift_top1_agreement",
                  "drift_token_match_rate", "drift_first_divergence_step")
    if ref32 is None:
        summary.update(dict.fromkeys(drift_keys))
        for col in ("drift_max_abs", "drift_mean_abs", "drift_kl", "drift_top1_agreement"):
            table[col] = np.nan
    else:
        diverged = [d for d in divergences if d is not None]
        summary.update(
            drift_max_abs=float(steps["drift_max_abs"].max()),
            drift_mean_abs=float(steps["drift_mean_abs"].mean()),
            drift_kl=float(steps["drift_kl"].mean()),
            drift_top1_agreement=float(steps["drift_top1_agree"].mean()),
            drift_token_match_rate=float(np.mean(match_rates)),
            drift_first_divergence_step=min(diverged) if diverged else None,
        )
        table["drift_max_abs"] = steps["drift_max_abs"].amax(0).numpy()
        table["drift_mean_abs"] = steps["drift_mean_abs"].mean(0).numpy()
        table["drift_kl"] = steps["drift_kl"].mean(0).numpy()
        table["drift_top1_agreement"] = steps["drift_top1_agree"].mean(0).numpy()
    return summary, table


# ---- time ------------------------------------------------------------------------------------------------------

def _timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def step_times(engine, layout: str, cache_dtype, context_lengths: list[int], max_len: int, repeats: int,
               warmup: int, device: torch.device, seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """Time one decode step at each context length: cached (a cache of ``layout`` holding ``ctx`` tokens, one token
    decoded, then rewound so every repeat runs at exactly ``ctx``) and uncached (a full forward over ctx + 1 tokens
    keeping the last logit: what one step costs without a cache). Median and spread over ``repeats`` after
    ``warmup``; the device is synchronised around every clock read. speedup = uncached / cached median."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    rows = []
    bar = tqdm(total=len(context_lengths) * 2 * (warmup + repeats), desc=f"step time ({layout})",
               disable=not progress)
    for ctx in context_lengths:
        seq = torch.randint(0, vocab, (1, ctx + 1), generator=g).to(device)
        prompt, token = seq[:, :ctx], seq[:, ctx:]
        cache = engine.new_cache(layout, max_len=max_len, dtype=cache_dtype)
        engine.prefill(prompt, cache)

        def cached_step():
            engine.decode(token, cache)

        def uncached_step():
            engine.forward_last(seq)

        timings = {}
        for mode, fn, after in (("cached", cached_step, lambda: engine.rewind(cache, 1)),
                                ("uncached", uncached_step, lambda: None)):
            ts = []
            for r in range(warmup + repeats):
                dt = _timed(fn, device)
                after()
                bar.update()
                if r >= warmup:
                    ts.append(dt)
            timings[mode] = _spread(ts)
        speedup = timings["uncached"]["ms_median"] / timings["cached"]["ms_median"]
        for mode, t in timings.items():
            rows.append(dict(context_len=ctx, mode=mode, **t, speedup=speedup))
    bar.close()
    return pd.DataFrame(rows)


def time_to_first_token(engine, layout: str, cache_dtype, prompt: torch.Tensor, max_len: int, repeats: int,
                        warmup: int, device: torch.device) -> dict:
    """Prefill of ``prompt`` into an empty cache (last position's logits only): median and spread."""
    cache = engine.new_cache(layout, max_len=max_len, dtype=cache_dtype)

    def once():
        engine.reset(cache)
        engine.prefill(prompt, cache, last_only=True)

    ts = [_timed(once, device) for _ in range(warmup + repeats)][warmup:]
    s = _spread(ts)
    return dict(ttft_ms=s["ms_median"], ttft_ms_p10=s["ms_p10"], ttft_ms_p90=s["ms_p90"])


# ---- memory ----------------------------------------------------------------------------------------------------

def cache_memory(engine, layout: str, cache_dtype, prompt: torch.Tensor, new_tokens: int, max_len: int) -> dict:
    """Fill a cache with a prompt and ``new_tokens - 1`` decode steps (what one generation stores) and compare its
    bytes with the formula: concat holds the tokens it stored, prealloc owns ``max_len`` slots from the start."""
    cache = engine.new_cache(layout, max_len=max_len, dtype=cache_dtype)
    logits = engine.prefill(prompt, cache, last_only=True)
    for _ in range(new_tokens - 1):
        logits = engine.decode(logits[:, -1:].argmax(-1), cache)
    c = engine.model.config
    filled = prompt.shape[1] + new_tokens - 1  # from the inputs, not from the cache's own bookkeeping
    held = filled if layout == "concat" else max_len
    predicted = kv_bytes(c.n_layer, c.n_head, c.head_dim, held, prompt.shape[0], cache_dtype)
    measured = engine.nbytes(cache)
    return dict(cache_nbytes=measured, predicted_nbytes=predicted, nbytes_match=measured == predicted,
                cache_tokens=held, cache_filled_tokens=filled,
                bytes_per_token=kv_bytes(c.n_layer, c.n_head, c.head_dim, 1, 1, cache_dtype),
                measured_bytes_per_token=measured / held)


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak for this run (sweep jobs may share one process). Returns whether the CPU peak could be
    reset (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device, reset_ok: bool) -> dict:
    if device.type == "cuda":
        return dict(peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)),
                    peak_memory_kind="cuda_max_allocated")
    if reset_ok:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):  # peak resident set since the reset, in kB
                return dict(peak_memory_bytes=int(line.split()[1]) * 1024, peak_memory_kind="process_peak_rss")
    # ru_maxrss is KiB on Linux, bytes on macOS; it covers the whole process, earlier runs in it included
    scale = 1 if platform.system() == "Darwin" else 1024
    return dict(peak_memory_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
                peak_memory_kind="process_max_rss_including_earlier_runs")


# ---- environment -----------------------------------------------------------------------------------------------

def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def attention_backend(device: torch.device) -> str:
    if device.type == "cuda":
        b = torch.backends.cuda
        on = [n for n, f in (("flash", b.flash_sdp_enabled), ("mem_efficient", b.mem_efficient_sdp_enabled),
                             ("math", b.math_sdp_enabled)) if f()]
        return "sdpa:" + "+".join(on)
    return "sdpa:cpu"


def fingerprint(device: torch.device, weights: str) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return dict(
        torch_version=torch.__version__,
        device_name=name,
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
        attn_backend=attention_backend(device),
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else False,
        git_commit=git_commit(),
        weights=weights,
        python_version=platform.python_version(),
    )

