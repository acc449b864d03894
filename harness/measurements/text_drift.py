"""Text drift: real text teacher-forced through the cache against FP32 full attention, llama.cpp's statistics."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import MAX_PROMPTS, shown, Measurement, Panel, Table, key, option, register


@register
class TextDrift(Measurement):
    name = "text_drift"
    about = "KL, ΔNLL, RMS Δp and same-top-1 on real text against fp32 full attention, and K/V error per layer"
    stage = "equivalence and drift"
    @classmethod
    def memory(cls, s, opts):
        """For a run that is not its own fp32 reference, L = min(max_len, max(drift_text_len, prompt_len + 1)), its
        texts passed B = ``text_rows`` at a time (at most drift_texts, or n_prompts): both passes' caches of B rows,
        the K/V recorded per layer (fp32), the reference's forward over (B, L - 1), both passes' logits (B, L - 1,
        V) in fp32 and the reference's prefill copied into its own (3 of them), and 7 float64 tensors of
        min(STAT_ROWS, L - 1) rows over the vocabulary."""
        if s.plain_fp32:
            return []
        from harness.core.measure import STAT_ROWS, text_rows
        from harness.core.sizes import F32, F64, I64
        from models.kv_cache import kv_bytes

        m, V = s.model, s.model.vocab_size
        L, texts = cls.text_len(s, opts), opts.drift_texts or s.n_prompts
        B, R = text_rows(L, V, texts), min(STAT_ROWS, L - 1)
        seen = 2 * kv_bytes(m.n_layer, m.n_kv_head, m.head_dim, L, B, "fp32")
        meas = s.forward(B, L - 1, 0, F32) + 3 * B * (L - 1) * V * F32 + 7 * R * V * F64 + seen + texts * L * I64
        return [("text_drift", s.cache_at(B, L, cap=L) + B * s.ref_cache(L), meas)]

    @classmethod
    def fills(cls, s, opts):
        return [] if s.plain_fp32 else [("text drift", 1, cls.text_len(s, opts) - 1)]

    @classmethod
    def inputs(cls, opts, src, s):
        """drift_texts (default n_prompts) disjoint texts of ``text_len`` tokens from across the prompts file (or
        random ids), for a run that is not its own fp32 reference."""
        if s.plain_fp32:
            return {}
        texts, paragraphs = src.texts(opts.drift_texts or s.n_prompts, cls.text_len(s, opts))
        return dict(texts=[t.to(s.device) for t in texts], text_paragraphs=paragraphs)

    @staticmethod
    def text_len(s, opts) -> int:
        """Tokens per text: drift_text_len, at least a prompt and one token, at most max_len."""
        return min(s.max_len, max(opts.drift_text_len, s.prompt_len + 1))

    @dataclass(frozen=True)
    class Options:
        drift_text_len: int = option(128, "tokens per text scored for drift: drift_texts texts, disjoint spans of "
                                          "the prompts file drawn from across it (at least prompt_len + 1)")
        drift_texts: int | None = option(None, "disjoint texts scored for drift (default: n_prompts); the units an "
                                               "interval on a drift figure resamples, so more texts, a narrower "
                                               "interval")

    @dataclass(frozen=True)
    class Result:
        drift_kl: float = key("mean KL(fp32 || run) over every scored position of the text", "nats", shown=True,
                              label="KL mean")
        drift_kl_p99: float = key("99th percentile of that KL", "nats", shown=True, label="KL p99")
        drift_kl_max: float = key("max of that KL", "nats", shown=True, label="KL max")
        drift_kl_decode: float | None = key("mean KL over the positions decode steps scored (not the prefill's)",
                                            "nats", shown=True, label="KL mean (decode)")
        drift_delta_nll: float = key("change in next-token NLL of the text against fp32's", "nats/token", shown=True,
                                     label="ΔNLL (nats/token)")
        drift_delta_ppl: float = key("change in perplexity of the text against fp32's", label="ΔPPL")
        drift_rms_dp: float = key("RMS change of the probability fp32 puts on its own top token", "probability",
                                  shown=True, label="RMS Δp")
        drift_same_top1: float = key("share of positions whose top token is fp32's", "fraction", shown=True,
                                     label="same top-1")
        text_nll_fp32: float = key("next-token NLL of the text in fp32 full attention", "nats/token")
        text_nll: float = key("next-token NLL of the text through the run's cache and dtype", "nats/token")
        drift_text_positions: int = key("positions scored", "positions")
        drift_texts: int = key("texts scored (disjoint spans of the prompts file; an interval's units)", "texts")
        drift_text_paragraphs: str | None = key("the prompts file's paragraphs (non-empty lines, from 1) each text "
                                                "spans, in text order: '3-4;7;...' (null: random ids)")
        drift_layer_tol: float = key("relative K/V error from which a layer counts as disagreeing")
        drift_first_layer_over_tol: int | None = key("first layer whose K or V is off fp32's by more than that "
                                                     "(null: none)", "layer", shown="report")
        drift_k_rel_err_max: float | None = key("largest relative error of K against fp32's, over layers",
                                                label="K rel err (max layer)")
        drift_v_rel_err_max: float | None = key("largest relative error of V against fp32's, over layers",
                                                label="V rel err (max layer)")

    tables = (Table("layers", "layers.csv", on=("layer",), columns=("layer", "k_rel_err", "v_rel_err"),
                    meaning="per layer: relative error of the K and V attention read, against fp32"),
              Table("text_positions", "text_positions.csv", on=("text", "position"),
                    columns=("text", "position", "text_id", "decoded", "kl", "nll", "nll_fp32", "same_top1"),
                    meaning="per scored position of each text: KL(fp32 || run), the run's and fp32's NLL of the "
                            "next token, whether the top token is fp32's; text_id names the text by its tokens (what "
                            "an interval over texts resamples)"))
    panels = (Panel("Drift on text", "bar", ("drift_kl", "drift_kl_decode", "drift_kl_p99", "drift_delta_nll",
                                             "drift_rms_dp"), ("cache_label", "dtype"),
                    "Teacher-forced drift on text vs fp32: mean and p99 KL, ΔNLL (nats/token), RMS Δp."),)

    @classmethod
    def check(cls, opts, max_len):
        from harness.common.errors import ConfigError

        if opts.drift_text_len < 2:
            raise ConfigError(f"drift_text_len={opts.drift_text_len} must be at least 2 (a token and the one it "
                              "predicts)")
        if opts.drift_texts is not None and not 1 <= opts.drift_texts <= MAX_PROMPTS:
            raise ConfigError(f"drift_texts={opts.drift_texts} must be 1 .. {MAX_PROMPTS:,} (texts scored for "
                              "drift), or left out for n_prompts")

    def skip(self):
        if self.ctx.ref32 is None:
            return "an exact kind in fp32 storage and compute is its own fp32 reference: nothing to drift from"
        if not self.ctx.texts:
            return "no texts to score"
        return None

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        summary, tables = measure.text_drift(ctx.engine, ctx.ref32, ctx.spec, ctx.texts, ctx.prompts[0].shape[1],
                                             ctx.progress)
        return self.Result(**summary, drift_texts=len(ctx.texts), drift_text_paragraphs=ctx.text_paragraphs), tables

    @classmethod
    def summary(cls, r, tables):
        kl = " · ".join(f"{name} {shown(r.get(k), '.3g')}" for name, k in (("p99", "drift_kl_p99"),
                                                                             ("max", "drift_kl_max")))
        return [f"  drift vs fp32     text: KL mean {shown(r.get('drift_kl'), '.3g')} "
                f"(decode {shown(r.get('drift_kl_decode'), '.3g')}) · {kl} · "
                f"dNLL {shown(r.get('drift_delta_nll'), '+.3g')} nats/token · "
                f"RMS dp {shown(r.get('drift_rms_dp'), '.3g')} · same top-1 {shown(r.get('drift_same_top1'), '.1%')}",
                f"  K/V vs fp32       K max {shown(r.get('drift_k_rel_err_max'), '.3g')} · V max "
                f"{shown(r.get('drift_v_rel_err_max'), '.3g')} (relative, vs fp32) · first layer over "
                f"{r['drift_layer_tol']:g}: {shown(r.get('drift_first_layer_over_tol'), 'd')}",
                f"  text NLL          {r['text_nll_fp32']:.3f} nats/token in fp32 (the model on the prompts' text)"]
