"""What a run measures, as pure functions: an engine and plain arguments in, plain dicts / DataFrames out.
No W&B, no files, no printing (a tqdm bar on stderr when ``progress`` is true is the one exception).

- ``CacheSpec``: the cache under test (kind, options, storage dtype); its class answers every kind-specific question.
- ``equivalence_check``, ``full_loop_check``: a cached generation vs the kind's uncached reference; ``drift_check``,
  ``text_drift``, ``diagnose_divergence``: vs FP32 full attention. (``harness.measurements`` makes the generations
  and runs these per prompt.)
- ``step_times``: one decode step at each context length, cached and uncached, median and spread of repeats.
- ``time_to_first_token``: prefill of the prompt.
- ``cache_memory``: the cache's bytes against the kind's formula, bytes vs tokens, and the process's peak memory.
- ``fingerprint``: what the numbers were measured on.
"""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from harness.common.stats import LAYER_TOL
from models import cpu_kernels
from models.kv_cache import CACHE_KINDS, KeepRecord, cache_kind, kv_bytes

REPO = Path(__file__).resolve().parents[2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return dict(ms_median=float(np.median(ms)), ms_p10=float(np.percentile(ms, 10)),
                ms_p90=float(np.percentile(ms, 90)), ms_min=float(ms.min()), repeats=len(ms))


# ---- the cache under test ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheSpec:
    """A cache kind with its options and storage dtype: what a run measures. Everything kind-specific is asked of
    the kind's class (``models.kv_cache``), never decided here by its name."""

    kind: str
    options: dict = field(default_factory=dict)
    dtype: torch.dtype | None = None  # storage; None: the model's

    @property
    def cls(self):
        return cache_kind(self.kind)

    @property
    def opts(self):
        return self.cls.parse_options(**self.options)

    @property
    def reference(self) -> dict:
        """Keyword arguments of the uncached forward this kind must equal ({}: full attention)."""
        return self.cls.reference(self.opts)

    @property
    def label(self) -> str:
        return self.cls.label(self.opts)

    def new(self, engine, max_len: int, batch: int = 1):
        return engine.new_cache(self.kind, max_len, batch, self.dtype, **self.options)

    def rows_at_once(self) -> int | None:
        """How many texts may share one cache of this spec (``text_batches``' ``most``): one where the options fix
        a pool of blocks that the run's checks sized for one sequence (``cache.blocks``), else no bound."""
        return 1 if self.cls.fixed_pool(self.cls.parse_options(**self.options)) else None

    def greedy(self, engine, prompt: torch.Tensor, n: int):
        return engine.greedy(prompt, n, layout=self.kind, cache_dtype=self.dtype, **self.options)


def full_attention_kind() -> str:
    """An exact kind whose reference is plain full attention: how FP32's own greedy tokens are made quickly."""
    return next(k for k, c in CACHE_KINDS.items() if c.full_attention(c.Options()))


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


def keep_reference(out) -> dict:
    """An evicting kind's generation: its reference is the keep-mask it noted (``keep=``); {} for every other run."""
    keeps = getattr(out, "keeps", None)
    return {} if keeps is None else {"keep": keeps}


def teacher_forced(engine, prompt: torch.Tensor, tokens: torch.Tensor, reference: dict | None = None) -> torch.Tensor:
    """One uncached forward (with a kind's ``reference`` visibility) over prompt + generated tokens: the logits
    (n, vocab) each generated token was chosen from, as the full model computes them."""
    seq = torch.cat([prompt, tokens], dim=1)  # (1, T + n)
    T, n = prompt.shape[1], tokens.shape[1]
    return engine.forward(seq, **(reference or {}))[0, T - 1:T - 1 + n]


def _first_true(mask: torch.Tensor) -> int | None:
    idx = torch.nonzero(mask)
    return int(idx[0]) if len(idx) else None


# ---- non-finite values: a run that produced NaN or inf never reports an equivalence --------------------------------

class NonFiniteError(RuntimeError):
    """Logits (or K/V) that are NaN or infinite: the run fails, with where they first appeared."""


def trace_non_finite(model, run) -> str | None:
    """Run ``run()`` with every block of ``model`` (and the K/V its caches return) watched; say where non-finite
    values first appear: a weight, the embeddings, a cache's K/V at some layer, or a block's output."""
    from models.decoder import Decoder

    if not isinstance(model, Decoder):
        return None
    bad = next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if bad:
        return f"the weight {bad}"
    first: list[str] = []

    def watch(what):
        def hook(module, inputs, output):
            if not first and not torch.isfinite(output).all():
                first.append(what)
        return hook

    handles = [model.get_input_embeddings().register_forward_hook(watch("the token embeddings"))]
    handles += [b.register_forward_hook(watch(f"layer {i}'s output")) for i, b in enumerate(model.blocks)]
    handles += [model.final_norm.register_forward_hook(watch("the final layer norm"))]
    try:
        with torch.inference_mode():
            run(first)
    finally:
        for h in handles:
            h.remove()
    return first[0] if first else None


def watched_cache(cache, first: list[str]):
    """Wrap ``cache.update`` so that the first K/V it returns with non-finite values is noted in ``first``."""
    update = cache.update

    def checked(layer, k, v):
        out = update(layer, k, v)
        if not first and not (torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()):
            first.append(f"the K/V the {cache.kind} cache returned at layer {layer}"
                         + ("" if torch.isfinite(k).all() and torch.isfinite(v).all() else " (written so)"))
        return out

    cache.update = checked
    return cache


def check_finite(logits: torch.Tensor, what: str, where=None) -> None:
    """Raise ``NonFiniteError`` naming the first step of ``logits`` (n, vocab), or the row and step of (B, n, vocab),
    that holds NaN or inf, and, when ``where()`` can tell, where in the model they first appear."""
    bad = ~torch.isfinite(logits.reshape(-1, logits.shape[-1])).all(-1)
    if bad.any():
        step = int(torch.nonzero(bad)[0])
        if logits.dim() == 3 and logits.shape[0] > 1:  # several texts' rows: which one, and where in it
            row, step = divmod(step, logits.shape[1])
            what = f"{what} (its row {row} of {logits.shape[0]})"
        place = where() if where is not None else None
        raise NonFiniteError(f"non-finite logits (NaN/inf) in {what} at step {step}"
                             + (f"; first non-finite values in {place}" if place else ""))


def locate_in_generation(engine, prompt: torch.Tensor, tokens: torch.Tensor, spec) -> str | None:
    """Replay a cached generation (prefill, then the generated tokens one by one) watching the model and the cache."""
    def replay(first):
        cache = watched_cache(spec.new(engine, prompt.shape[1] + tokens.shape[1]), first)
        engine.prefill(prompt, cache)
        for i in range(tokens.shape[1] - 1):
            if first:
                return
            engine.decode(tokens[:, i:i + 1], cache)

    return trace_non_finite(getattr(engine, "model", None), replay)


def locate_in_forward(engine, seq: torch.Tensor, reference: dict) -> str | None:
    return trace_non_finite(getattr(engine, "model", None), lambda first: engine.forward(seq, **reference))


def equivalence_check(engine, prompt: torch.Tensor, out, reference: dict) -> dict:
    """Teacher-forced equivalence of one cached generation ``out`` against the kind's uncached reference: per-step
    logit stats, the first step whose token the reference would not have chosen, and the reference logits."""
    ref_logits = teacher_forced(engine, prompt, out.tokens, reference)
    check_finite(ref_logits, "the uncached reference", lambda: locate_in_forward(
        engine, torch.cat([prompt, out.tokens], dim=1), reference))
    return dict(stats=logit_stats(out.logits[0], ref_logits), ref_logits=ref_logits,
                first_wrong=_first_true(ref_logits.argmax(-1) != out.tokens[0]))


def full_loop_check(engine, prompt: torch.Tensor, out, reference: dict) -> dict:
    """The true uncached loop (the reference re-run over the whole context every step) against ``out``: the first
    step the two choose different tokens, and max |dlogit| up to and including it (after it they read different
    contexts, so their logits no longer mean the same thing)."""
    n = out.tokens.shape[1]
    loop = engine.greedy(prompt, n, layout=None, **reference)
    split = _first_true(loop.tokens[0] != out.tokens[0])
    upto = n if split is None else split + 1
    return dict(first_split=split,
                max_abs=(out.logits[0, :upto].float() - loop.logits[0, :upto].float()).abs().max().item())


def drift_check(ref32, prompt: torch.Tensor, out, ref_logits: torch.Tensor | None = None) -> dict:
    """The same tokens through the FP32 full-attention model: per-step logit stats against it, and FP32's own greedy
    tokens against ours (match rate, first divergence). ``ref_logits``: FP32's teacher-forced logits, if known."""
    n = out.tokens.shape[1]
    ref = teacher_forced(ref32, prompt, out.tokens) if ref_logits is None else ref_logits
    check_finite(ref, "the fp32 drift reference")
    want = ref32.greedy(prompt, n, layout=full_attention_kind()).tokens[0]
    return dict(stats=logit_stats(out.logits[0], ref), match_rate=(want == out.tokens[0]).float().mean().item(),
                first_divergence=_first_true(want != out.tokens[0]))


def equivalence_summary(checks: list[dict], new_tokens: int) -> tuple[dict, pd.DataFrame]:
    """Per-prompt equivalence and full-loop checks -> the run's equivalence numbers and per-step table. A prompt's
    first wrong step is the earlier of the teacher-forced mismatch and the full loop's first split."""
    eq = _stack([c["eq"] for c in checks])  # (n_prompts, new_tokens) each
    loops = [c["loop"] for c in checks if c["loop"] is not None]
    firsts = [min((s for s in (c["first_wrong"], c["loop"] and c["loop"]["first_split"]) if s is not None),
                  default=None) for c in checks]
    wrong = [(step, i) for i, step in enumerate(firsts) if step is not None]
    first_diff, at = min(wrong) if wrong else (None, None)
    summary = dict(
        tokens_identical=not wrong,
        max_abs_logit_diff=max([float(eq["max_abs"].max())] + [lp["max_abs"] for lp in loops]),
        first_diff_step=first_diff,
        margin_at_first_diff=None if at is None else float(eq["ref_margin"][at, first_diff]),
        min_ref_margin=float(eq["ref_margin"].min()),
        equivalence_method=f"teacher_forced({len(checks)})+full_loop({len(loops)})",
        teacher_forced_prompts=len(checks),
        full_loop_prompts=len(loops),
        full_loop_tokens_identical=all(lp["first_split"] is None for lp in loops) if loops else None,
    )
    table = pd.DataFrame({"step": np.arange(new_tokens), "eq_max_abs_diff": eq["max_abs"].amax(0).numpy(),
                          "eq_top1_agreement": eq["top1_agree"].mean(0).numpy()})
    return summary, table


def drift_summary_of(checks: list[dict], new_tokens: int) -> tuple[dict, pd.DataFrame]:
    """Per-prompt drift checks -> the run's drift numbers and per-step columns (None / NaN without drift)."""
    d = _stack([c["drift"]["stats"] for c in checks])
    diverged = [c["drift"]["first_divergence"] for c in checks if c["drift"]["first_divergence"] is not None]
    summary = dict(
        drift_max_abs=float(d["max_abs"].max()),
        drift_mean_abs=float(d["mean_abs"].mean()),
        drift_gen_kl=float(d["kl"].mean()),
        drift_top1_agreement=float(d["top1_agree"].mean()),
        drift_token_match_rate=float(np.mean([c["drift"]["match_rate"] for c in checks])),
        drift_first_divergence_step=min(diverged) if diverged else None,
    )
    table = pd.DataFrame({"drift_max_abs": d["max_abs"].amax(0).numpy(),
                          "drift_mean_abs": d["mean_abs"].mean(0).numpy(), "drift_kl": d["kl"].mean(0).numpy(),
                          "drift_top1_agreement": d["top1_agree"].mean(0).numpy()})
    return summary, table


# ---- drift statistics as llama.cpp's perplexity tool reports them (--kl-divergence) ----------------------------

STAT_ROWS = 128  # positions whose float64 log-softmax over the vocabulary is held at once (text_drift)
NEAR_TIE = 2.0  # a divergence is a near tie when the reference's top-1/top-2 margin < NEAR_TIE x max |dlogit| there

def recorded(cache, seen: dict):
    """Wrap ``cache.update`` so that ``seen[layer]`` holds the (K, V, key positions) its last call returned (for a
    kind that fuses decode attention, also ``attend_decode``: the K/V its last step read, as update returns them)."""
    update = cache.update

    def recording(layer, k, v):
        per_head = cache.layer_key_positions(layer, k.shape[2])  # an evicting kind's keys: (B, nh, n), before update
        out = update(layer, k, v)
        seen[layer] = (out[0], out[1], per_head if per_head is not None else cache.key_positions(k.shape[2]))
        return out

    cache.update = recording
    if cache.fuses_decode:  # a fused decode step writes and attends without update: record what it read
        attend = cache.attend_decode

        def attending(layer, q, k, v, mask=None):
            y = attend(layer, q, k, v, mask)
            seen[layer] = (*cache.stored_history(layer), cache.key_positions(1))  # a decode step writes 1 token
            return y

        cache.attend_decode = attending
    return cache


def text_pass(engine, spec: CacheSpec, seq: torch.Tensor, T: int) -> tuple[torch.Tensor, dict]:
    """Teacher-forced text through a cache, as inference runs: prefill ``seq[:, :T]``, then the rest one decode step
    at a time. Returns the logits (L - 1, vocab) that predicted tokens 1 .. L - 1 and, per layer, the (K, V, key
    positions) attention read at the last step (empty for caches that are not ours)."""
    logits, seen = text_pass_rows(engine, spec, seq, T)
    return logits[0], seen


def text_pass_rows(engine, spec: CacheSpec, seqs: torch.Tensor, T: int) -> tuple[torch.Tensor, dict]:
    """``text_pass`` of B texts of one length (B, L) at once, each a row of one batched cache: prefill ``seqs[:, :T]``
    together, then one decode step of every row at a time (every kind keeps its rows apart: the conformance suite
    holds each row to its text passed alone). Returns the logits (B, L - 1, vocab) and what ``text_pass`` records,
    for the whole batch."""
    B, L = seqs.shape
    T = max(1, min(T, L - 1))
    seen: dict = {}
    cache = spec.new(engine, L, B)
    if hasattr(cache, "key_positions"):
        recorded(cache, seen)
    first = engine.prefill(seqs[:, :T], cache)  # (B, T, vocab)
    logits = torch.empty(B, L - 1, first.shape[-1], dtype=torch.float32, device=first.device)  # filled in place
    logits[:, :T] = first
    del first
    for i in range(T, L - 1):
        logits[:, i] = engine.decode(seqs[:, i:i + 1], cache)[:, -1]
    return logits, seen


TEXT_ROWS_BYTES = 1 << 30  # the most one batch of texts' float32 logits may take (text_drift, retrieval)


def text_rows(length: int, vocab: int, texts: int | None = None) -> int:
    """How many texts of ``length`` tokens ``text_drift`` passes at once: as many as keep their float32 logits
    within ``TEXT_ROWS_BYTES`` (at least one; at most ``texts``)."""
    rows = max(1, TEXT_ROWS_BYTES // (4 * vocab * max(length, 1)))
    return rows if texts is None else max(1, min(rows, texts))


def engine_vocab(engine) -> int:
    """The vocabulary an engine's logits span (its model's config; GPT-2's where the model does not say)."""
    return getattr(getattr(engine.model, "config", None), "vocab_size", None) or 50257


def text_batches(texts: list[torch.Tensor], vocab: int, most: int | None = None) -> list[list[int]]:
    """The texts' indices in the batches ``text_drift`` passes together: texts of one length, in order, at most
    ``text_rows`` at once (and at most ``most``)."""
    groups: list[list[int]] = []
    for i, seq in enumerate(texts):
        rows = text_rows(seq.shape[1], vocab, most)
        last = groups[-1] if groups else None
        if last and texts[last[0]].shape[1] == seq.shape[1] and len(last) < rows:
            last.append(i)
        else:
            groups.append([i])
    return groups


def kv_errors(seen: dict, ref: dict) -> pd.DataFrame:
    """Per layer: squared error of K and V against the reference's at the same positions, and the reference's squared
    norm (sums, so prompts add up); ``k_rel_err`` / ``v_rel_err`` = sqrt(error / norm)."""
    rows = []
    for layer in sorted(set(seen) & set(ref)):
        k, v, pos = seen[layer]
        kr, vr, _ = ref[layer]
        if pos is not None and pos.dim() == 3:  # per sequence and head, -1 empty: compare the held keys alone
            pos = pos.to(kr.device)
            held = (pos >= 0).unsqueeze(-1)  # (B, nh, n, 1)
            at = pos.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, kr.shape[-1])
            kr, vr = kr.gather(2, at).where(held, 0), vr.gather(2, at).where(held, 0)
            k, v = k.where(held, 0), v.where(held, 0)
        elif pos is not None:
            kr, vr = kr[:, :, pos.to(kr.device)], vr[:, :, pos.to(vr.device)]
        ek, ev = (k.double() - kr.double()).pow(2).sum().item(), (v.double() - vr.double()).pow(2).sum().item()
        nk, nv = kr.double().pow(2).sum().item(), vr.double().pow(2).sum().item()
        rows.append(dict(layer=layer, k_err2=ek, k_norm2=nk, v_err2=ev, v_norm2=nv))
    df = pd.DataFrame(rows, columns=["layer", "k_err2", "k_norm2", "v_err2", "v_norm2"])
    return _with_rel(df)


def _with_rel(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["k_rel_err"] = np.sqrt(df.k_err2 / df.k_norm2.where(df.k_norm2 > 0))
    df["v_rel_err"] = np.sqrt(df.v_err2 / df.v_norm2.where(df.v_norm2 > 0))
    return df


def first_layer_over(layers: pd.DataFrame, tol: float = LAYER_TOL) -> int | None:
    over = layers[(layers.k_rel_err > tol) | (layers.v_rel_err > tol)]
    return None if over.empty else int(over.layer.min())


def _text_stats(ours: torch.Tensor, ref: torch.Tensor, target: torch.Tensor, out: tuple) -> None:
    """Append one text's per-position KL(ref || ours), NLLs, Δp on ref's top token and same-top-1 to ``out`` (five
    lists), in float64 over the vocabulary, ``STAT_ROWS`` positions at a time."""
    kl, nll, nll_ref, dp, same = out
    for a in range(0, len(target), STAT_ROWS):
        rows = slice(a, a + STAT_ROWS)
        lp, lr = ours[rows].double().log_softmax(-1), ref[rows].double().log_softmax(-1)
        t = target[rows, None]
        kl.append((lr.exp() * (lr - lp)).sum(-1).clamp_min(0))
        nll.append(-lp.gather(-1, t)[:, 0])
        nll_ref.append(-lr.gather(-1, t)[:, 0])
        top = lr.argmax(-1, keepdim=True)
        dp.append(lp.gather(-1, top)[:, 0].exp() - lr.gather(-1, top)[:, 0].exp())
        same.append((lp.argmax(-1) == top[:, 0]).double())


def text_drift(engine, ref32, spec: CacheSpec, texts: list[torch.Tensor], T: int,
               progress: bool = False) -> tuple[dict, dict[str, pd.DataFrame]]:
    """Drift on real text, teacher-forced, against FP32 with the exact full-attention cache on the same tokens:
    KL(fp32 || ours) mean / p99 / max over every scored position, the change in next-token NLL of the text (ΔNLL,
    nats/token, and ΔPPL), the RMS change of the probability fp32 puts on its own top token (RMS Δp: llama.cpp's
    Δp uses the text's next token instead), how often the top token is the same, and the per-layer relative error of
    K and V (``layers``). ``drift_kl_decode`` is the KL mean over the positions scored by decode steps alone (not
    the prefill's): what to compare across caches that treat a prefill differently (HF's QuantizedCache attends
    to the prompt's K/V unquantised, ours to what it stored). Tables: ``layers`` and ``text_positions`` (every scored
    position of every text: its KL, NLL and fp32's NLL, same top-1; ``text_id`` names the text by its tokens, so two
    runs' rows pair text by text)."""
    ref_spec = CacheSpec(full_attention_kind(), {}, torch.float32)  # the reference: the whole text in one forward
    # (exact attention needs no decode steps to be what inference computes: equivalence checks that within 1e-4)
    kl, nll, nll_ref, dp, same, layers, decoded, which = [], [], [], [], [], [], [], []
    vocab = engine_vocab(engine)
    bar = tqdm(total=len(texts), desc=f"text drift ({spec.label})", disable=not progress)
    for group in text_batches(texts, vocab, spec.rows_at_once()):  # one decode step serves several texts
        seqs = torch.cat([texts[i] for i in group])
        ours_rows, seen = text_pass_rows(engine, spec, seqs, T)
        check_finite(ours_rows, f"the cached text pass of texts {group[0]}..{group[-1]}")
        ref_rows, seen_ref = text_pass_rows(ref32, ref_spec, seqs, seqs.shape[1] - 1)  # fp32: one forward
        ref_rows = ref_rows.to(ours_rows.device)
        for row, i in enumerate(group):
            seq, ours, ref = texts[i], ours_rows[row], ref_rows[row]
            decoded.append(torch.arange(ours.shape[0]) >= max(1, min(T, seq.shape[1] - 1)))  # after the prefill
            target = seq[0, 1:].to(ours.device)
            which.append((i, text_id(seq), len(target)))
            _text_stats(ours, ref, target, (kl, nll, nll_ref, dp, same))
        layers.append(kv_errors(seen, seen_ref))
        del ours_rows, ref_rows, ours, ref, seen, seen_ref  # the next batch's passes need their room
        bar.update(len(group))
    bar.close()
    kl, nll, nll_ref = torch.cat(kl).cpu(), torch.cat(nll).cpu(), torch.cat(nll_ref).cpu()
    decoded = torch.cat(decoded)
    dp, same = torch.cat(dp).cpu(), torch.cat(same).cpu()
    per_layer = pd.concat(layers).groupby("layer", as_index=False)[["k_err2", "k_norm2", "v_err2", "v_norm2"]].sum()
    per_layer = _with_rel(per_layer)[["layer", "k_rel_err", "v_rel_err"]]
    summary = dict(
        drift_kl=float(kl.mean()), drift_kl_p99=float(torch.quantile(kl, 0.99)), drift_kl_max=float(kl.max()),
        drift_kl_decode=float(kl[decoded].mean()) if decoded.any() else None,
        drift_delta_nll=float(nll.mean() - nll_ref.mean()),
        drift_delta_ppl=float(nll.mean().exp() - nll_ref.mean().exp()),
        drift_rms_dp=float(dp.pow(2).mean().sqrt()), drift_same_top1=float(same.mean()),
        text_nll_fp32=float(nll_ref.mean()), text_nll=float(nll.mean()), drift_text_positions=int(kl.numel()),
        drift_layer_tol=LAYER_TOL,
        drift_first_layer_over_tol=first_layer_over(per_layer) if len(per_layer) else None,
        drift_k_rel_err_max=float(per_layer.k_rel_err.max()) if len(per_layer) else None,
        drift_v_rel_err_max=float(per_layer.v_rel_err.max()) if len(per_layer) else None,
    )
    positions = pd.DataFrame(dict(
        text=[i for i, _, n in which for _ in range(n)], position=[p for *_, n in which for p in range(n)],
        text_id=[t for _, t, n in which for _ in range(n)], decoded=decoded.int().numpy(), kl=kl.numpy(),
        nll=nll.numpy(), nll_fp32=nll_ref.numpy(), same_top1=same.int().numpy()))
    return summary, {"layers": per_layer, "text_positions": positions}


def text_id(seq: torch.Tensor) -> str:
    """A text named by its tokens (12 hex digits of their SHA-1): the same text in two runs has the same id."""
    return hashlib.sha1(seq.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def diagnose_divergence(engine, ref32, spec: CacheSpec, prompt: torch.Tensor, tokens: list[int], step: int,
                        margin: float, max_abs: float) -> dict:
    """Where cached greedy tokens first leave FP32's: the step, FP32's top-1/top-2 margin there against the run's
    usual logit drift ``max_abs`` (the median max |Δlogit| of the steps before it: a margin within twice that is a
    near tie that the precision or the lossy cache flipped; a margin far beyond it means that step's drift jumped:
    look for a bug, unless the kind drops keys, evicting or windowed, whose cost that is), and the first layer whose K or V, read at that step, is off fp32's by more than
    ``LAYER_TOL``."""
    seq = torch.cat([prompt, torch.tensor([tokens[:step + 1]], device=prompt.device)], dim=1)
    _, seen = text_pass(engine, spec, seq, prompt.shape[1])
    _, seen_ref = text_pass(ref32, CacheSpec(full_attention_kind(), {}, torch.float32), seq, prompt.shape[1])
    layers = kv_errors(seen, seen_ref)
    layer = first_layer_over(layers) if len(layers) else None
    tie = margin < NEAR_TIE * max_abs
    cause = "the lower precision" if spec.cls.exact else f"the lossy {spec.kind} cache"
    drops = spec.cls.evicts or bool(spec.reference)  # it attends over fewer keys than fp32 full attention does
    far = ("the margin is far beyond the usual drift: expected of a cache that drops keys (the " + spec.kind
           + " cache no longer holds keys fp32 attends to; its own reference is checked by equivalence)" if drops
           else "the margin is far beyond the usual drift: look for a bug")
    why = (f"step {step}: fp32's top-1/top-2 margin {margin:.3g} vs the run's usual max |dlogit| {max_abs:.3g}: "
           + (f"a near tie flipped by {cause}" if tie else far)
           + ("; K/V not recorded (not kvlab's cache)" if not seen else
              f"; K/V first off by > {LAYER_TOL:g} (relative) at layer {layer}" if layer is not None else
              f"; no layer's K/V is off by > {LAYER_TOL:g} (relative)"))
    return dict(drift_margin_at_divergence=margin, drift_near_tie=tie, drift_divergence_layer=layer,
                drift_divergence_diagnosis=why)


def _stack(per_prompt: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-prompt stats (each (n,)) -> one (n_prompts, n) tensor per stat, on the CPU."""
    return {k: torch.stack([s[k].cpu() for s in per_prompt]) for k in per_prompt[0]}


# ---- time ------------------------------------------------------------------------------------------------------

def _timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def step_times(engine, spec: CacheSpec, context_lengths: list[int], max_len: int, repeats: int, warmup: int,
               device: torch.device, seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """Time one decode step at each context length: cached (a cache of ``spec`` holding ``ctx`` tokens, one token
    decoded, then put back as it was, so every repeat runs at exactly ``ctx``) and uncached (the kind's reference
    forward over ctx + 1 tokens keeping the last logit: what one step costs without a cache). Median and spread
    over ``repeats`` after ``warmup``; the device is synchronised around every clock read. speedup = uncached /
    cached median."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    reference = spec.reference
    rows = []
    bar = tqdm(total=len(context_lengths) * 2 * (warmup + repeats), desc=f"step time ({spec.label})",
               disable=not progress)
    for ctx in context_lengths:
        seq = torch.randint(0, vocab, (1, ctx + 1), generator=g).to(device)
        prompt, token = seq[:, :ctx], seq[:, ctx:]
        cache = spec.new(engine, max_len)
        engine.prefill(prompt, cache, last_only=True)
        back = engine.checkpoint(cache)

        def cached_step():
            engine.decode(token, cache)

        def uncached_step():
            engine.forward_last(seq, **reference)

        timings = {}
        for mode, fn, after in (("cached", cached_step, back), ("uncached", uncached_step, lambda: None)):
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


# ---- bandwidth: a decode step reads every weight once plus the K/V history --------------------------------------

def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (the tied output embedding is the token
    embedding, read whole by the output projection), but only one row of the position embedding."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
        if name.endswith("wpe.weight"):  # one position's row is read, not the table
            total -= (p.shape[0] - 1) * p.shape[1] * p.element_size()
    return total


def kv_read_bytes(engine, spec: CacheSpec, max_len: int, ctx: int, batch: int = 1) -> int:
    """Bytes of K/V one decode step at context ``ctx`` reads: the kind's bytes per cached token (its storage dtype,
    scales included) times the tokens attention reads (ctx + 1, or the slots a window keeps)."""
    n_layer, n_kv_head, head_dim = geometry(engine)
    cls, opts = storage(engine, spec), spec.opts
    dtype = spec.dtype or next(engine.model.parameters()).dtype
    return round(cls.bytes_per_token(n_layer, n_kv_head, head_dim, dtype, opts) * keys_read(engine, spec, max_len, ctx)
                 * batch)


def storage(engine, spec: CacheSpec, prefilled: int = 0):
    """What knows the bytes ``engine``'s cache for ``spec`` holds (``held_tokens``, ``nbytes_formula``,
    ``bytes_per_token``): the kind's class, unless the engine stores it its own way (HF's QuantizedCache, whose
    bytes also depend on the ``prefilled`` prompt's length)."""
    return engine.storage(spec, prefilled)


def keys_read(engine, spec: CacheSpec, max_len: int, ctx: int) -> int:
    """Keys one decode step at context ``ctx`` attends over: ctx + 1, or the slots a window keeps; an engine whose
    cache hands attention more (HF's StaticCache: all ``max_len`` slots, masked) says so (``keys_read``)."""
    got = engine.keys_read(spec.kind, ctx, max_len)
    return got if got is not None else min(ctx + 1, spec.cls.held_tokens(max_len, ctx + 1, spec.opts))


def step_flops(engine, spec: CacheSpec, max_len: int, ctx: int, batch: int = 1) -> int:
    """Floating-point operations of one decode step: 2 per weight multiply-add (every matrix; the position table is
    a lookup) and, per layer, 2 x 2 x d per key read (q.k and the weighted sum of V)."""
    n_layer, n_kv_head, head_dim = geometry(engine)
    matrices = sum(p.numel() for n, p in engine.model.named_parameters() if p.dim() == 2 and "wpe" not in n)
    read = keys_read(engine, spec, max_len, ctx)
    return batch * (2 * matrices + 4 * n_layer * n_kv_head * head_dim * read)


def with_bandwidth(steps: pd.DataFrame, engine, spec: CacheSpec, max_len: int,
                   probe_gbps: float | None = None, batch: int = 1) -> pd.DataFrame:
    """steps.csv's cached rows gain ``weight_bytes``, ``kv_bytes``, ``bytes_read`` (their sum), ``gb_per_s``
    (bytes_read / median step time), ``flops`` and ``flop_per_byte`` (arithmetic intensity) and, given the same
    run's ``probe_gbps``, the roofline: ``roofline_ms`` (the time reading bytes_read at the probe's bandwidth takes,
    the least a memory-bound step can cost) and ``roofline_fraction`` (roofline_ms / median step time: 1 at the
    machine's limit). ``batch``: the sequences each step decodes (their K/V and FLOPs add up; the weights are read
    once). Uncached rows (a full forward: compute, not a read of the cache) get NaN."""
    steps = steps.copy()
    w = weight_bytes(engine.model)
    cached = steps["mode"] == "cached"
    kv = steps["context_len"].map(lambda c: kv_read_bytes(engine, spec, max_len, int(c), batch))
    steps["flops"] = np.where(cached, steps["context_len"].map(
        lambda c: step_flops(engine, spec, max_len, int(c), batch)), np.nan)
    steps["weight_bytes"] = np.where(cached, w, np.nan)
    steps["kv_bytes"] = np.where(cached, kv, np.nan)
    steps["bytes_read"] = steps["weight_bytes"] + steps["kv_bytes"]
    steps["gb_per_s"] = steps["bytes_read"] / (steps["ms_median"] * 1e-3) / 1e9
    steps["flop_per_byte"] = steps["flops"] / steps["bytes_read"]
    roofline = steps["bytes_read"] / (probe_gbps * 1e9) * 1e3 if probe_gbps else np.nan
    steps["roofline_ms"] = roofline
    steps["roofline_fraction"] = steps["roofline_ms"] / steps["ms_median"]
    return steps


def batch_throughput(engine, spec: CacheSpec, batches: list[int], ctx: int, max_len: int, repeats: int,
                     warmup: int, device: torch.device, seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """Decode throughput against batch size: a cache of ``spec`` holding ``ctx`` tokens for each of B sequences
    decodes one token per sequence, then is put back; median of ``repeats`` after ``warmup``. Per batch size:
    ``ms_median``, ``tokens_per_s`` (B / step time), and what the step reads: the weights once for the whole batch
    and every sequence's K/V (``weight_bytes``, ``kv_bytes``). Decode amortises the weights over the batch until
    the K/V reads dominate (``kv_bytes`` > ``weight_bytes``)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    w = weight_bytes(engine.model)
    rows = []
    for B in tqdm(batches, desc=f"batches ({spec.label})", disable=not progress):
        seq = torch.randint(0, vocab, (B, ctx + 1), generator=g).to(device)
        cache = spec.new(engine, max_len, B)
        engine.prefill(seq[:, :ctx], cache, last_only=True)
        back = engine.checkpoint(cache)
        ts = []
        for r in range(warmup + repeats):
            dt = _timed(lambda: engine.decode(seq[:, ctx:], cache), device)
            back()
            if r >= warmup:
                ts.append(dt)
        t = _spread(ts)
        rows.append(dict(batch=B, context_len=ctx, **t, tokens_per_s=B / (t["ms_median"] * 1e-3), weight_bytes=w,
                         kv_bytes=kv_read_bytes(engine, spec, max_len, ctx, B)))
    df = pd.DataFrame(rows)
    df["gb_per_s"] = (df.weight_bytes + df.kv_bytes) / (df.ms_median * 1e-3) / 1e9
    return df


def batch_summary(batches: pd.DataFrame) -> dict:
    """The batch at which the K/V read overtakes the weight read (from the byte counts: weight / K/V bytes per
    sequence), and throughput at the smallest and largest batch measured."""
    if batches is None or batches.empty:
        return dict(batch_kv_overtakes_weights_at=None, tokens_per_s_batch_min=None, tokens_per_s_batch_max=None,
                    batch_max=None)
    per_seq = float(batches.kv_bytes.iloc[0]) / float(batches.batch.iloc[0])
    lo, hi = batches.loc[batches.batch.idxmin()], batches.loc[batches.batch.idxmax()]
    return dict(batch_kv_overtakes_weights_at=float(batches.weight_bytes.iloc[0]) / per_seq if per_seq else None,
                tokens_per_s_batch_min=float(lo.tokens_per_s), tokens_per_s_batch_max=float(hi.tokens_per_s),
                batch_max=int(hi.batch))


def compiled_equivalence(compiled, eager, spec: CacheSpec, prompt: torch.Tensor, steps: int, max_len: int) -> dict:
    """The compiled decode step against the eager one from the same prompt: both caches prefilled alike, then
    ``steps`` decode steps each fed the eager step's greedy token. Max |Δlogit| and whether every argmax agrees."""
    a, b = spec.new(eager, max_len), spec.new(compiled, max_len)
    la, lb = eager.prefill(prompt, a, last_only=True), compiled.prefill(prompt, b, last_only=True)
    worst, same = 0.0, True
    for _ in range(steps):
        nxt = la[:, -1:].argmax(-1)
        la, lb = eager.decode(nxt, a), compiled.decode(nxt, b)
        worst = max(worst, float((la.float() - lb.float()).abs().max()))
        same &= bool(torch.equal(la[:, -1].argmax(-1), lb[:, -1].argmax(-1)))
    return dict(compile_max_abs_logit=worst, compile_tokens_identical=same)


def _serve_once(engine, cache, idx: torch.Tensor, pad, new_tokens: int, device: torch.device,
                noted: KeepRecord | None, keep_logits: bool) -> tuple[float, float, list, list]:
    """One timed serving of the batch into ``cache``: (prefill s, decode s, the tokens chosen per step, and with
    ``keep_logits`` the logits they were chosen from, on the CPU); ``noted`` is told of every forward."""
    sync(device)
    t0 = time.perf_counter()
    if noted is not None:
        noted.note(cache, idx.shape[1])
    logits = engine.prefill(idx, cache, last_only=True, pad=pad)[:, -1]
    sync(device)
    t1 = time.perf_counter()
    chosen, seen = [], []
    for i in range(new_tokens):
        nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
        chosen.append(nxt)
        if keep_logits:
            seen.append(logits.float().cpu())
        if i + 1 < new_tokens:
            if noted is not None:
                noted.note(cache, 1)
            logits = engine.decode(nxt, cache)[:, -1]
    sync(device)
    return t1 - t0, time.perf_counter() - t1, chosen, seen


def serve_batch(engine, spec: CacheSpec, prompts: list[torch.Tensor], new_tokens: int, max_len: int,
                repeats: int, warmup: int, device: torch.device, check: bool = True) -> dict:
    """One batch served as a server would: prompts of their own lengths (1-D each; different lengths are
    left-padded) prefilled together, then ``new_tokens`` greedy tokens each, a fresh cache every repeat (median
    of ``repeats`` after ``warmup``).

    Returns throughput (``tokens_per_s``: generated tokens over prefill + decode; ``decode_tokens_per_s``: over
    the decode steps alone), the batch's time to first token, and what the cache holds at the end: slots held,
    slots that hold a token, ``kv_waste`` (the held share that holds none) and bytes. With ``check`` (an exact
    kind), every sequence is compared with its own uncached reference run on its own tokens:
    ``serve_tokens_identical`` and ``serve_max_abs_logit``."""
    from models.generate import left_pad

    B = len(prompts)
    idx, pad = left_pad(prompts)
    idx = idx.to(device)
    pad = pad if bool(pad.any()) else None
    runs = []
    for r in range(warmup + repeats):
        cache = spec.new(engine, max_len, B)
        last = r == warmup + repeats - 1
        # what an evicting kind held before each forward of the checked (last) repeat: each sequence's reference
        noted = KeepRecord(pad) if last and getattr(cache, "evicts", False) else None
        prefill_s, decode_s, chosen, seen = _serve_once(engine, cache, idx, pad, new_tokens, device, noted, last)
        if r >= warmup:
            runs.append((prefill_s, decode_s))
    prefill_s = float(np.median([a for a, _ in runs]))
    decode_s = float(np.median([b for _, b in runs]))
    total = float(np.median([a + b for a, b in runs]))
    rec = dict(serve_batch=B, serve_prompt_tokens=int(sum(len(p) for p in prompts)),
               serve_longest_prompt=int(max(len(p) for p in prompts)),
               serve_shortest_prompt=int(min(len(p) for p in prompts)),
               tokens_per_s=B * new_tokens / total,
               decode_tokens_per_s=B * (new_tokens - 1) / decode_s if new_tokens > 1 else None,
               serve_ttft_ms=prefill_s * 1e3)
    nbytes = engine.nbytes(cache)
    held = getattr(cache, "held_slots", None)
    rec.update(kv_held_slots=held, kv_token_slots=getattr(cache, "occupied_slots", None),
               kv_waste=getattr(cache, "waste", None), serve_cache_nbytes=nbytes,
               serve_pool_nbytes=getattr(cache, "pool_nbytes", None))
    rec.update(serve_tokens_identical=None, serve_max_abs_logit=None)
    if check:
        rec.update(served_check(engine, spec, prompts, torch.cat(chosen, dim=1).cpu(), torch.stack(seen, dim=1),
                                device, noted))
    return rec


def served_check(engine, spec: CacheSpec, prompts: list[torch.Tensor], tokens: torch.Tensor, logits: torch.Tensor,
                 device: torch.device, noted: KeepRecord | None = None) -> dict:
    """Each served sequence against its own uncached reference run on its own tokens: ``tokens`` (B, n) and the
    ``logits`` (B, n, vocab) the batch chose them from; ``noted``: an evicting kind's keep-mask of the batch."""
    same, worst = True, 0.0
    for i, p in enumerate(prompts):
        ctx = torch.cat([p.cpu(), tokens[i, :-1]]).unsqueeze(0).to(device)
        keep = {} if noted is None else {"keep": noted.sequence(i)}
        ref = engine.forward(ctx, **spec.reference, **keep)[0, len(p) - 1:].float().cpu()  # (n, vocab)
        same &= bool(torch.equal(ref.argmax(-1), tokens[i]))
        worst = max(worst, float((ref - logits[i]).abs().max()))
    return dict(serve_tokens_identical=same, serve_max_abs_logit=worst)


def bandwidth_probe(device: torch.device, nbytes: int, repeats: int = 9) -> dict:
    """The machine's memory bandwidth, measured here (and its fp32 matrix-multiply rate, for the machine balance):
    a copy of a ``max(nbytes, 256 MiB)`` buffer (read + write) and
    a matrix-vector product whose matrix has ``nbytes`` (a decode step's weight read); GB/s of the median of
    ``repeats`` after one warm-up. ``probe_gbps`` is the better of the two: what a step could reach."""
    nbytes = min(nbytes, 1 << 30)  # a GiB says the bandwidth as well as more would, without crowding out the model
    n = max(nbytes, 256 << 20) // 4
    src = torch.full((n,), 1.0, device=device)  # what is copied does not matter, only that every page is touched
    dst = torch.empty_like(src)
    cols = 1024
    rows = max(1, nbytes // 4 // cols)
    mat, vec = torch.randn(rows, cols, device=device), torch.randn(cols, device=device)
    out = {}
    for name, fn, moved in (("copy", lambda: dst.copy_(src), 2 * n * 4), ("matvec", lambda: mat @ vec,
                                                                          rows * cols * 4)):
        ts = [_timed(fn, device) for _ in range(repeats + 1)][1:]
        out[f"probe_{name}_gbps"] = moved / float(np.median(ts)) / 1e9
    out["probe_gbps"] = max(out["probe_copy_gbps"], out["probe_matvec_gbps"])
    out["probe_bytes"] = rows * cols * 4
    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    ts = [_timed(lambda: a @ b, device) for _ in range(repeats + 1)][1:]
    out["probe_gflops"] = 2 * 1024 ** 3 / float(np.median(ts)) / 1e9  # fp32 matrix-matrix: compute-bound
    out["machine_balance"] = out["probe_gflops"] / out["probe_gbps"]  # flop/byte where compute meets bandwidth
    return out


def time_to_first_token(engine, spec: CacheSpec, prompt: torch.Tensor, max_len: int, repeats: int, warmup: int,
                        device: torch.device) -> dict:
    """Prefill of ``prompt`` into an empty cache (last position's logits only): median and spread."""
    cache = spec.new(engine, max_len)

    def once():
        engine.reset(cache)
        engine.prefill(prompt, cache, last_only=True)

    ts = [_timed(once, device) for _ in range(warmup + repeats)][warmup:]
    s = _spread(ts)
    return dict(ttft_ms=s["ms_median"], ttft_ms_p10=s["ms_p10"], ttft_ms_p90=s["ms_p90"])


# ---- memory ----------------------------------------------------------------------------------------------------

def geometry(engine) -> tuple[int, int, int]:
    """(n_layer, n_kv_head, head_dim) of either engine's model: what its cache stores per token (kvlab's configs
    name them so; HF's Llama-family configs say num_hidden_layers / num_key_value_heads, and GPT-2's has no
    head_dim)."""
    c = engine.model.config
    n_layer = getattr(c, "n_layer", None) or c.num_hidden_layers
    n_head = getattr(c, "n_head", None) or c.num_attention_heads
    n_kv = getattr(c, "n_kv_head", None) or getattr(c, "num_key_value_heads", None) or n_head
    width = getattr(c, "n_embd", None) or c.hidden_size
    return n_layer, n_kv, getattr(c, "head_dim", None) or width // n_head


def cache_memory(engine, spec: CacheSpec, prompt: torch.Tensor, new_tokens: int, max_len: int,
                 curve_points: int = 64) -> tuple[dict, pd.DataFrame]:
    """Fill a cache with a prompt and ``new_tokens - 1`` decode steps (what one generation stores) and compare its
    bytes with the kind's formula, computed from the inputs and the ASKED storage dtype (not the cache's own
    bookkeeping). Also returns bytes vs tokens: measured after the prefill and every step, and the formula at
    ``curve_points`` lengths out to ``max_len`` (where the generation does not reach)."""
    cls, opts = storage(engine, spec, prompt.shape[1]), spec.opts
    n_layer, n_kv_head, head_dim = geometry(engine)
    dtype = spec.dtype or next(engine.model.parameters()).dtype
    B = prompt.shape[0]

    def formula(n: int) -> int:
        return cls.nbytes_formula(n_layer, n_kv_head, head_dim, max_len, B, dtype, n, opts)

    cache = spec.new(engine, max_len, B)
    logits = engine.prefill(prompt, cache, last_only=True)
    measured = {prompt.shape[1]: engine.nbytes(cache)}
    for i in range(new_tokens - 1):
        logits = engine.decode(logits[:, -1:].argmax(-1), cache)
        measured[prompt.shape[1] + i + 1] = engine.nbytes(cache)
    filled = prompt.shape[1] + new_tokens - 1  # from the inputs, not from the cache's own bookkeeping
    held = cls.held_tokens(max_len, filled, opts)
    predicted = formula(filled)
    grid = sorted(set(np.linspace(0, max_len, curve_points).round().astype(int).tolist()) | set(measured))
    curve = pd.DataFrame({"tokens": grid, "nbytes_formula": [formula(n) for n in grid],
                          "nbytes_measured": [measured.get(n, np.nan) for n in grid]})
    rec = dict(cache_nbytes=measured[filled], predicted_nbytes=predicted, nbytes_match=measured[filled] == predicted,
               cache_tokens=held, cache_filled_tokens=filled,
               bytes_per_token=cls.bytes_per_token(n_layer, n_kv_head, head_dim, dtype, opts),
               measured_bytes_per_token=measured[filled] / held,
               nbytes_curve_match=all(curve.nbytes_formula[curve.nbytes_measured.notna()]
                                      == curve.nbytes_measured.dropna()),
               nbytes_at_max_len=formula(max_len) // B,
               full_nbytes_at_max_len=kv_bytes(n_layer, n_kv_head, head_dim, max_len, 1, torch.float32))
    return rec, curve, head_slots(cache, n_layer, n_kv_head, min(held, filled))


HEAD_COLUMNS = ("layer", "kv_head", "slots", "tokens", "role")


def head_slots(cache, n_layer: int, n_kv_head: int, held: int) -> pd.DataFrame:
    """One row per layer and K/V head of a filled cache (sequence 0): the ``slots`` it holds room for, the
    ``tokens`` in them, and its ``role`` where the kind gives heads one (duo: retrieval or streaming). A kind that
    spends its slots per head says so (``slots_of``); every other holds ``held`` tokens in each head."""
    rows = []
    roles = getattr(cache, "head_roles", lambda layer: None)
    for layer in range(n_layer):
        if hasattr(cache, "slots_of"):
            slots = cache.slots_of(layer)[0]
            tokens = (cache.kept_positions(layer)[0] >= 0).sum(-1).tolist()
        else:
            slots = tokens = [held] * n_kv_head
        role = roles(layer) or [""] * n_kv_head
        rows += [dict(layer=layer, kv_head=h, slots=slots[h], tokens=tokens[h], role=role[h]) for h in range(n_kv_head)]
    return pd.DataFrame(rows, columns=list(HEAD_COLUMNS))


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


def fingerprint(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return dict(
        torch_version=torch.__version__,
        device_name=name,
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
        attn_backend=attention_backend(device),
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else False,
        git_commit=git_commit(),
        python_version=platform.python_version(),
        cpu_kernels=cpu_kernels.path() if device.type == "cpu" else "torch",
    )

