"""The papers' claims kvlab checks, each beside kvlab's number from a paper preset's sweep.

A claim is about one setting, stated once, in its preset's YAML (conf/experiment/<preset>.yaml, read here by
``preset``); ``PAPERS`` maps each preset to its claims, one to one with the paper_*.yaml files (a test holds them
to it). A claim's verdict reads only runs that recorded its setting, and only when its control can show the effect
(full attention that copies, a window that costs something); otherwise it is "not judged", and says which setting
differs or why nothing can be judged.

    from harness.analysis import papers
    papers.claim_rows(runs)          # [] for a sweep that is not a paper preset
    papers.preset("paper_h2o")       # what its YAML fixes, links and sweeps

Pure but for reading the presets' YAML: DataFrames in, dataclasses and text out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
from omegaconf import OmegaConf

from harness.analysis.plots import as_written
from harness.measurements import KEYS


@dataclass(frozen=True)
class Claim:
    """A paper's claim and how to read kvlab's answer from a preset's runs. Its setting is its preset's (the cache
    kind, dtype, engine and cache options conf/experiment/<preset>.yaml states) and the top-level keys of that YAML
    it names in ``about`` ("weights": a trained model). ``ours(runs of that setting)`` returns (what it compares,
    our number, whether the direction holds (None: the sweep cannot tell; ``NotJudged``: its control cannot show
    the effect), the runs read)."""

    claim: str
    source: str  # paper, table or PR
    paper_setting: str
    paper_number: str
    ours: Callable[["Runs"], tuple[str, str, "bool | None | NotJudged", tuple[str, ...]]]
    about: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimRow:
    claim: str
    source: str
    paper_setting: str
    paper_number: str
    our_setting: str
    our_number: str  # "not judged: <why>" when not judged
    holds: bool | None  # None: not judged, or no direction to judge, or its runs are missing
    runs: tuple[str, ...]
    not_judged: str = ""  # why there is no verdict: a setting the runs differ in, or a control that cannot show it


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs[KEYS.status] == "ok"] if KEYS.status in runs else runs.iloc[0:0]


def value(row: pd.Series | None, key: str) -> float | None:
    if row is None or key not in row or pd.isna(row[key]):
        return None
    return float(row[key])


def names(*rows) -> tuple[str, ...]:
    return tuple(str(r[KEYS.run_name]) for r in rows if r is not None and KEYS.run_name in r)


def num(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:+.2e}" if signed else f"{x:.2e}"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def missing(*rows) -> tuple[str, str, None, tuple]:
    return "—", "not in this sweep (a run failed or was not asked for)", None, names(*rows)


def ppl_change(row: pd.Series | None) -> float | None:
    """Perplexity change of the text against fp32 full attention, in percent."""
    nll, ref = value(row, KEYS.text_nll), value(row, KEYS.text_nll_fp32)
    return None if nll is None or ref is None else 100.0 * (math.exp(nll - ref) - 1.0)


# ---- the papers' claims ------------------------------------------------------------------------------------------
#
# A claim is about one setting, and its verdict reads only runs of that setting. The setting has one home: the
# preset's YAML (conf/experiment/<preset>.yaml), read here (``preset``): the cache kind, dtype and engine its defaults
# pick, every cache option it sets to a value, and the top-level keys the claim names (``Claim.about``: the texts'
# length, the copies', the prompts), with ``weights`` (a trained model) for a claim about quality. What a claim
# compares (its arms: 0 vs 4 sinks, K per channel vs per token) are values the preset sweeps. A run that has an arm
# but not the setting is not read: the claim gives no verdict and says which setting differs ("not judged"), as it
# does when a control cannot show the effect (full attention that does not copy, a window that costs nothing).

CONF = Path(__file__).resolve().parents[2] / "conf" / "experiment"
GROUPS = ("cache", "dtype", "engine")  # the config groups a preset's defaults pick that its claims are about
TRAINED = "weights"  # in Claim.about: about a trained model (a random init's drift and copying say nothing)
TEXT = ("drift_text_len", "prompts", TRAINED)  # a claim read from drift on the prompts' text, as long as the preset
# says (shorter texts may never fill a quantisation group, or never leave a window: they measure something else)
COPY = ("retrieval_n", TRAINED)  # a claim read from copying random sequences
# options of a preset's cache kind that its claims are not about, and why; every other option the preset sets (or
# links to another: v_bits: ${cache.k_bits}) or sweeps (tests/analysis/test_findings.py holds each preset to this)
NOT_ABOUT = {
    "paper_streamingllm": {"cache.window": "set by the budget: the budget less the sinks"},
    "paper_rotation": {"cache.v_bits": "V is not quantised (quantize k)", "cache.v_axis": "V is not quantised "
                                                                                          "(quantize k)"},
}


@dataclass(frozen=True)
class Preset:
    """What conf/experiment/<name>.yaml fixes: ``fixed`` ("cache": the kind, "dtype", "engine", "model": what its
    defaults pick; "cache.<option>": each option it sets to a value; each top-level key it sets), ``linked`` (cache
    options it sets to another's value, as written) and ``swept`` ("cache.<option>" -> the values its sweep takes)."""

    name: str
    fixed: dict
    linked: dict
    swept: dict


def _parsed(text: str):
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


def preset(name: str) -> Preset:
    """The paper preset ``name`` as its YAML states it (the one home of every setting its claims are about)."""
    y = OmegaConf.load(CONF / f"{name}.yaml")
    fixed, linked = {}, {}
    for item in y.get("defaults") or []:
        if OmegaConf.is_dict(item):  # "override /cache: h2o"
            for k, v in item.items():
                fixed[str(k).split()[-1].strip("/")] = v
    cache = y.get("cache") or {}
    for k in cache:
        if OmegaConf.is_interpolation(cache, k):
            linked[f"cache.{k}"] = OmegaConf.to_container(cache)[k]
        else:
            fixed[f"cache.{k}"] = cache[k]
    for k in y:
        if k not in ("defaults", "cache", "hydra", "experiment"):
            fixed[k] = OmegaConf.to_container(y[k]) if OmegaConf.is_config(y[k]) else y[k]
    params = OmegaConf.select(y, "hydra.sweeper.params") or {}
    swept = {k: tuple(_parsed(v) for v in str(vals).split(",")) for k, vals in params.items()}
    return Preset(name, fixed, linked, swept)


def claim_setting(preset_name: str, claim: Claim) -> dict:
    """The setting ``claim`` is about, key (as on the command line) -> value: its preset's cache kind, dtype,
    engine and cache options, and the keys of ``claim.about``."""
    p = preset(preset_name)
    out = {k: p.fixed[k] for k in ("cache", *(k for k in p.fixed if k.startswith("cache.")), *GROUPS[1:])}
    for k in claim.about:
        if k == TRAINED:
            out[k] = "pretrained"
        elif k in p.fixed:
            out[k] = p.fixed[k]
        else:
            raise KeyError(f"conf/experiment/{preset_name}.yaml does not state {k}, which the claim "
                           f"{claim.claim!r} is about")
    return out


def recorded(row: pd.Series, key: str):
    """What a run recorded for the setting ``key`` (None: nothing). ``drift_text_len`` is the texts' length as run
    (the drift scores each of its n_prompts texts at its length less one positions; max_len cuts them)."""
    if key == "drift_text_len":
        pos, n = value(row, KEYS.drift_text_positions), value(row, KEYS.n_prompts)
        return None if pos is None or not n else round(pos / n) + 1
    col = f"cache_{key[len('cache.'):]}" if key.startswith("cache.") else key
    v = row.get(col)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else as_written(v)


class Runs:
    """The ok runs of a preset's sweep as one claim reads them: only those of ``setting`` (``claim_setting``)."""

    def __init__(self, ok: pd.DataFrame, setting: dict):
        self.ok, self.setting = ok, setting
        self.differ: dict[str, set] = {}  # setting -> what the runs an arm found have instead

    def run(self, **arm) -> pd.Series | None:
        """The first ok run with the cache options ``arm`` and the claim's setting; when no run with the arm has
        the setting, the first with the arm, what it has instead kept in ``differ`` (the claim names it and gives
        no verdict); None when no run has the arm."""
        sel = self.ok
        for name, value in arm.items():
            col = f"cache_{name}"
            if col not in sel:
                return None
            sel = sel[sel[col].map(as_written) == value]
        rows = [r for _, r in sel.iterrows()]
        diffs = [{k: recorded(r, k) for k, v in self.setting.items() if recorded(r, k) != v} for r in rows]
        for r, d in zip(rows, diffs):
            if not d:
                return r
        for d in diffs:
            for k, v in d.items():
                self.differ.setdefault(k, set()).add(v)
        return rows[0] if rows else None

    def differences(self) -> str:
        """'the runs have <key> <theirs>, the claim is about <ours>; ...' ("" when every run read is of the
        setting)."""
        if not self.differ:
            return ""
        parts = [f"{k} {' / '.join(setting_value(k, v) for v in sorted(self.differ[k], key=str))}, the claim is "
                 f"about {setting_value(k, v)}" for k, v in self.setting.items() if k in self.differ]
        return "the runs have " + "; ".join(parts)


def setting_value(key: str, v) -> str:
    """A setting's value as a not-judged row shows it."""
    if v is None:
        return "nothing recorded"
    if key == TRAINED:
        return {"pretrained": "pretrained (a trained model)", "random": "random (a random init)"}.get(v, str(v))
    return str(v)


def setting_text(setting: dict) -> str:
    """The setting in words, every key once: 'quant, groups of 32, no residual, rotate none, fp32, ...'."""
    def one(k, v):
        if k == "cache.residual":
            return "no residual" if v == 0 else f"residual {v}"
        if k == TRAINED:
            return "trained weights" if v == "pretrained" else f"weights {v}"
        form = {"cache": "{}", "cache.budget": "{} slots", "cache.group_size": "groups of {}",
                "cache.k_axis": "K per {}", "cache.v_axis": "V per {}", "dtype": "{}", "engine": "engine {}",
                "drift_text_len": "texts of {:,} tokens", "retrieval_n": "copies of {:,} tokens",
                "prompts": "prompts={}"}.get(k)
        return form.format(v) if form else f"{k[len('cache.'):] if k.startswith('cache.') else k} {v}"
    return ", ".join(one(k, v) for k, v in setting.items())


@dataclass(frozen=True)
class NotJudged:
    """In a claim's verdict's place: why its runs cannot show the effect it is about."""

    why: str


def _copy_control(row) -> NotJudged | None:
    """Full attention (fp32, uncached) must copy more of the second showing than anything gets right of the first
    (nothing to copy yet), or no cache can be shown to lose copying."""
    ref, first = value(row, KEYS.retrieval_acc_ref), value(row, KEYS.retrieval_first_copy_acc)
    if ref is None:
        return NotJudged("full attention's copying is not recorded, so a cache cannot be shown to lose copying")
    if ref <= (first or 0.0):
        return NotJudged(f"full attention itself copies {ref:.1%} of the second copy (the first, with nothing to "
                         f"copy yet: {first or 0.0:.1%}), so a cache cannot be shown to lose copying")
    return None


def _series(rows: list, key: str, fmt=lambda x: num(x, signed=True)) -> str:
    return " / ".join(fmt(value(r, key)) for r in rows)


SINKS = (0, 1, 2, 4, 8)  # StreamingLLM Table 2's sink counts


def _streaming_rows(at: Runs) -> dict[int, pd.Series | None]:
    return {s: at.run(sinks=s) for s in SINKS}


def _streaming_table1(at):
    r = _streaming_rows(at)
    d0, d4 = value(r[0], KEYS.drift_delta_nll), value(r[4], KEYS.drift_delta_nll)
    if d0 is None or d4 is None:
        return missing(r[0], r[4])
    w0, w4 = int(r[0]["cache_window"]), int(r[4]["cache_window"])
    holds = d4 < d0 if d0 > 0 else NotJudged(f"the window without sinks costs nothing (ΔNLL {num(d0, True)}), so "
                                             "there is no collapse for sinks to prevent")
    return (f"0 sinks + {w0} recent vs 4 sinks + {w4}; ΔNLL over {_text_len(r[0])} positions of held-out text",
            f"ΔNLL {num(d0, True)} vs {num(d4, True)} (perplexity ×{math.exp(d0):.2f} vs ×{math.exp(d4):.2f})",
            holds, names(r[0], r[4]))


def _text_len(row) -> str:
    n = value(row, KEYS.drift_text_positions)
    return "the scored" if n is None else f"{int(n):,}"


def _no_gap(d0: float, d4: float, what: str) -> NotJudged:
    return NotJudged(f"4 sinks do not lower the window's ΔNLL ({num(d0, True)} without sinks, {num(d4, True)} "
                     f"with 4), so there is nothing for {what}")


def _streaming_table2(at):
    r = _streaming_rows(at)
    d = {s: value(row, KEYS.drift_delta_nll) for s, row in r.items()}
    if None in d.values():
        return missing(*r.values())
    recovered = (d[0] - d[1]) / (d[0] - d[4]) if d[0] > d[4] else float("nan")
    return (" / ".join(map(str, SINKS)) + " sinks; ΔNLL",
            _series(list(r.values()), KEYS.drift_delta_nll)
            + (f"; 1 sink recovers {100 * recovered:.0f}% of what 4 do" if d[0] > d[4] else ""),
            bool(recovered >= 0.5) if d[0] > d[4] else _no_gap(d[0], d[4], "one sink to recover"),
            names(*r.values()))


def _streaming_eight(at):
    r = _streaming_rows(at)
    d0, d4, d8 = (value(r[s], KEYS.drift_delta_nll) for s in (0, 4, 8))
    if None in (d0, d4, d8):
        return missing(r[0], r[4], r[8])
    holds = abs(d8 - d4) <= 0.25 * (d0 - d4) if d0 > d4 else _no_gap(d0, d4, "8 sinks to add to or not")
    return ("4 vs 8 sinks; ΔNLL", f"{num(d4, True)} vs {num(d8, True)} (the 0-sink gap: {num(d0 - d4)})", holds,
            names(r[0], r[4], r[8]))


def _streaming_copy(at):
    r = _streaming_rows(at)
    if any(value(row, KEYS.retrieval_acc) is None for row in r.values()):
        return missing(*r.values())
    acc = [value(row, KEYS.retrieval_acc) for row in r.values()]
    ref = value(r[0], KEYS.retrieval_acc_ref)
    return (" / ".join(map(str, SINKS)) + " sinks; accuracy on the second copy",
            " / ".join(num(a) for a in acc) + f" (full attention {num(ref)})",
            _copy_control(r[0]) or bool(max(acc) < 0.5 * ref), names(*r.values()))


def _kivi(at, k_axis, v_axis, bits=2):
    return at.run(k_bits=bits, v_bits=bits, k_axis=k_axis, v_axis=v_axis)


def _kivi_k_channel(at):
    best, tok = _kivi(at, "channel", "token"), _kivi(at, "token", "token")
    a, b = value(best, KEYS.drift_delta_nll), value(tok, KEYS.drift_delta_nll)
    if a is None or b is None:
        return missing(best, tok)
    return ("2-bit: K per channel + V per token vs both per token; ΔNLL (KL p99)",
            f"{num(a, True)} ({num(value(best, KEYS.drift_kl_p99))}) vs {num(b, True)} "
            f"({num(value(tok, KEYS.drift_kl_p99))})", a < b, names(best, tok))


def _kivi_v_channel(at):
    vt = [_kivi(at, k, "token") for k in ("channel", "token")]
    vc = [_kivi(at, k, "channel") for k in ("channel", "token")]
    d_t, d_c = ([value(r, KEYS.drift_delta_nll) for r in rows] for rows in (vt, vc))
    if None in d_t + d_c:
        return missing(*vt, *vc)
    return ("2-bit: V per channel (K per channel / per token) vs V per token (the same); ΔNLL",
            f"{num(d_c[0], True)} / {num(d_c[1], True)} vs {num(d_t[0], True)} / {num(d_t[1], True)}",
            min(d_c) > max(d_t), names(*vc, *vt))


def _kivi_four_bits(at):
    rows = [_kivi(at, k, v, bits=4) for k, v in (("channel", "token"), ("token", "token"), ("channel", "channel"),
                                                   ("token", "channel"))]
    d = [value(r, KEYS.drift_delta_nll) for r in rows]
    if None in d:
        return missing(*rows)
    return ("4-bit: Kc+Vt / Kt+Vt / Kc+Vc / Kt+Vc; ΔNLL", " / ".join(num(x, True) for x in d),
            d[0] < d[1] and min(d[2:]) > max(d[:2]), names(*rows))


def _h2o(at, role):
    """H2O's ablation at the preset's budget: heavy hitters alone (recent 0), both (recent half the budget) and
    the newest tokens alone ("local": recent the whole budget)."""
    budget = at.setting["cache.budget"]
    return at.run(recent={"heavy": 0, "both": budget // 2, "local": budget}[role])


def _h2o_both(at):
    heavy, both, local = _h2o(at, "heavy"), _h2o(at, "both"), _h2o(at, "local")
    d = [value(r, KEYS.drift_delta_nll) for r in (both, local, heavy)]
    if None in d:
        return missing(both, local, heavy)
    budget, text = at.setting["cache.budget"], at.setting["drift_text_len"]
    return (f"a budget of {100 * budget / text:.0f}% of the text: both (recent {budget // 2}) / local (recent "
            f"{budget}) / heavy only (recent 0); ΔNLL", " / ".join(num(x, True) for x in d), d[0] < min(d[1:]),
            names(both, local, heavy))


def _h2o_heavy_text(at):
    heavy, local = _h2o(at, "heavy"), _h2o(at, "local")
    a, b = value(heavy, KEYS.drift_delta_nll), value(local, KEYS.drift_delta_nll)
    if a is None or b is None:
        return missing(heavy, local)
    return "heavy hitters alone vs the newest tokens alone; ΔNLL", f"{num(a, True)} vs {num(b, True)}", a < b, \
        names(heavy, local)


def _h2o_heavy_copy(at):
    heavy, both, local = _h2o(at, "heavy"), _h2o(at, "both"), _h2o(at, "local")
    acc = [value(r, KEYS.retrieval_acc) for r in (heavy, both, local)]
    if None in acc:
        return missing(heavy, both, local)
    return (f"heavy only / both / local; accuracy on the second copy (full attention "
            f"{num(value(heavy, KEYS.retrieval_acc_ref))})", " / ".join(num(a) for a in acc),
            _copy_control(heavy) or acc[0] > acc[2], names(heavy, both, local))


def _kv_type(at, quantize, bits=8):
    return at.run(k_bits=bits, v_bits=bits, quantize=quantize)


def _kv_types_k_more(at, bits=8):
    k, v = _kv_type(at, "k", bits), _kv_type(at, "v", bits)
    a, b = value(k, KEYS.drift_kl), value(v, KEYS.drift_kl)
    if a is None or b is None:
        return missing(k, v)
    return (f"{bits}-bit: K alone vs V alone; mean KL on text",
            f"{num(a)} vs {num(b)} ({a / b:.2f}×)" if b else f"{num(a)} vs {num(b)}", a > b, names(k, v))


def _kv_types_both(at):
    k, v, both = _kv_type(at, "k"), _kv_type(at, "v"), _kv_type(at, "kv")
    a, b, c = (value(r, KEYS.drift_kl) for r in (k, v, both))
    if None in (a, b, c):
        return missing(k, v, both)
    return ("8-bit: both vs K alone (V alone beside); mean KL", f"{num(c)} vs {num(a)} ({c / a:.2f}×; V alone "
            f"{num(b)})" if a else f"{num(c)} vs {num(a)}", bool(a and c <= 1.25 * a), names(both, k, v))


def _rotation(at, bits, rotate):
    return at.run(k_bits=bits, rotate=rotate)


def _rotation_ppl(at, bits=4):
    plain, rot = _rotation(at, bits, "none"), _rotation(at, bits, "hadamard")
    a, b = ppl_change(plain), ppl_change(rot)
    if a is None or b is None:
        return missing(plain, rot)
    return (f"K alone, {bits}-bit, without / with rotate=hadamard; perplexity of held-out text against fp32",
            f"{a:+.2f}% vs {b:+.2f}%", b < a, names(plain, rot))


def _rotation_cost(at):
    plain, rot = _rotation(at, 4, "none"), _rotation(at, 4, "hadamard")
    a, b = (value(r, KEYS.step_ms_cached_at_max_context) for r in (plain, rot))
    if a is None or b is None:
        return missing(plain, rot)
    ctx = int(value(plain, KEYS.max_context_len) or 0)
    return (f"the 4-bit runs' decode step at context {ctx}", f"{a:.2f} vs {b:.2f} ms ({b / a:.2f}×)", None,
            names(plain, rot))


STREAMINGLLM = "StreamingLLM (Xiao et al., arXiv 2309.17453)"
KIVI = "KIVI (Liu et al., arXiv 2402.02750)"
H2O = "H2O (Zhang et al., arXiv 2306.14048)"
LLAMACPP = "llama.cpp PR 7412"
ROTATION = "ik_llama.cpp pull request 1034"
WINDOW_TEXT = TEXT  # the window and H2O claims: the texts must be long against the budget
PAPERS: dict[str, tuple[Claim, ...]] = {
    "paper_streamingllm": (
        Claim("a few attention sinks keep window attention from collapsing", f"{STREAMINGLLM}, Table 1",
              "Llama-2-13B, PG19: 0 sinks + 1,024 recent vs 4 sinks + 1,020; perplexity", "5158.07 vs 5.40",
              _streaming_table1, WINDOW_TEXT),
        Claim("one sink recovers most of it", f"{STREAMINGLLM}, Table 2",
              "Llama-2-7B: 0 / 1 / 2 / 4 / 8 sinks; perplexity", "3359.95 / 11.88 / 10.51 / 9.59 / 9.54",
              _streaming_table2, WINDOW_TEXT),
        Claim("beyond 4 sinks little changes", f"{STREAMINGLLM}, Table 2", "Llama-2-7B: 4 vs 8 sinks",
              "9.59 vs 9.54", _streaming_eight, WINDOW_TEXT),
        Claim("a window cannot copy what it no longer holds, sinks or not", f"{STREAMINGLLM}, §3 and Appendix",
              "the paper: sinks do not extend the context the model sees", "—", _streaming_copy, COPY),
    ),
    "paper_kivi": (
        Claim("K wants a scale per channel, V per token", f"{KIVI}, Table 1",
              "Llama-2-13B, 2-bit, group 32, CoQA (higher is better): K per channel + V per token vs both per token",
              "63.53 vs 52.93", _kivi_k_channel, TEXT),
        Claim("V per channel collapses", f"{KIVI}, Table 1", "Llama-2-13B, 2-bit, V per channel, CoQA", "2.88",
              _kivi_v_channel, TEXT),
        Claim("the same ordering at 4 bits, with smaller gaps", f"{KIVI}, Table 1 (2-bit figures only quoted here)",
              "—", "—", _kivi_four_bits, TEXT),
    ),
    "paper_h2o": (
        Claim("heavy hitters plus recent tokens come close to full attention, far better than either alone",
              f"{H2O}, Table 6", "OPT-30B, PiQA, 20% budget: full / local / heavy / both; accuracy",
              "78.51 / 55.82 / 67.25 / 78.45", _h2o_both, WINDOW_TEXT),
        Claim("heavy hitters alone beat recent tokens alone", f"{H2O}, Table 6",
              "OPT-30B, PiQA, 20% budget: heavy vs local", "67.25 vs 55.82", _h2o_heavy_text, WINDOW_TEXT),
        Claim("... and on copying old text", f"{H2O}, Table 6 (the claim, on retrieval)", "heavy vs local",
              "67.25 vs 55.82", _h2o_heavy_copy, COPY),
    ),
    "paper_kv_types": (
        Claim("at 8 bits the K cache is the more sensitive", LLAMACPP,
              "KL divergence vs f16, q8_0 blocks of 32 (f16-weights baseline 0.000189): V alone vs K alone",
              "0.000743 vs 0.000944", _kv_types_k_more, TEXT),
        Claim("K dominates: both cost about what K alone costs (within 1.25×)", LLAMACPP, "both vs K alone",
              "0.000980 vs 0.000944 (1.04×)", _kv_types_both, TEXT),
        Claim("K the more sensitive at 4 bits too", f"{LLAMACPP} (8-bit figures only quoted here)", "—", "—",
              lambda at: _kv_types_k_more(at, bits=4), TEXT),
    ),
    "paper_rotation": (
        Claim("a Hadamard rotation rescues a 4-bit K cache", ROTATION,
              "Qwen3-30B-A3B, K cache Q4_0, without / with a Hadamard rotation; perplexity change",
              "+11.30% vs +0.92%", _rotation_ppl, TEXT),
        Claim("... and a 2-bit one", f"{ROTATION} (4-bit figures only quoted here)", "—", "—",
              lambda at: _rotation_ppl(at, bits=2), TEXT),
        Claim("what the rotation costs a step", "kvlab (no paper figure)", "—", "—", _rotation_cost),
    ),
}


def preset_of(runs: pd.DataFrame) -> str | None:
    """The paper preset the sweep's runs were made by (their ``experiment``), if it is one and they agree."""
    if KEYS.experiment not in runs:
        return None
    names = set(runs[KEYS.experiment].dropna())
    return names.pop() if len(names) == 1 and next(iter(names)) in PAPERS else None


def claim_row(claim: Claim, preset_name: str, ok: pd.DataFrame) -> ClaimRow:
    """One claim with kvlab's answer from the ok runs of its setting; "not judged" (``not_judged`` says why) when
    the runs it needs are of another setting or its control cannot show the effect."""
    row = ClaimRow(claim.claim, claim.source, claim.paper_setting, claim.paper_number, "—", "—", None, ())
    try:
        setting = claim_setting(preset_name, claim)
        at = Runs(ok, setting)
        phrase, number, holds, names = claim.ours(at)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OSError) as e:
        return dataclasses.replace(row, our_number=f"could not be read ({type(e).__name__}: {e})")
    ours = setting_text(setting) + ("" if phrase == "—" else f": {phrase}")
    why = [w for w in (at.differences(), holds.why if isinstance(holds, NotJudged) else "") if w]
    if why and number.startswith("not in this sweep"):
        why.append("and some of its runs are not in this sweep")
    if why:
        return dataclasses.replace(row, our_setting=ours, our_number="not judged: " + "; ".join(why), runs=names,
                                   not_judged="; ".join(why))
    return dataclasses.replace(row, our_setting=ours, our_number=number, holds=holds, runs=names)


def claim_rows(runs: pd.DataFrame) -> list[ClaimRow]:
    """The claims of the paper preset that made ``runs``, each with kvlab's answer from them; [] for any other
    sweep."""
    preset_name = preset_of(runs)
    if preset_name is None:
        return []
    ok = ok_runs(runs)
    return [claim_row(c, preset_name, ok) for c in PAPERS[preset_name]]


NOT_JUDGED = "not judged"


def holds_text(h: bool | None) -> str:
    return {True: "holds", False: "does not hold", None: "—"}[h]


def verdict_text(row: ClaimRow) -> str:
    """The direction column: holds, does not hold, not judged, or — (nothing to judge, or its runs are missing)."""
    return NOT_JUDGED if row.not_judged else holds_text(row.holds)
