"""Equivalence: the cached greedy generation against the kind's uncached reference, in the same compute dtype."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Table, key, option, register


@register
class Equivalence(Measurement):
    name = "equivalence"
    about = "cached greedy tokens and logits against the kind's uncached reference (teacher-forced + full loop)"
    reads_generations = True
    stage = "equivalence and drift"

    @dataclass(frozen=True)
    class Options:
        full_prompts: int | None = option(None, "prompts (at most n_prompts) also checked with the true uncached "
                                                "loop; default 1 on CPU, all on GPU")
        equivalence_tol: float = option(1e-4, "an exact kind in fp32 whose max |dlogit| exceeds this is "
                                              "not_equivalent")

    @dataclass(frozen=True)
    class Result:
        tokens_identical: bool = key("every prompt's cached greedy tokens are the reference's", shown=True)
        max_abs_logit_diff: float = key("max |cached - reference logit| over every prompt and step", "logit",
                                        shown=True)
        first_diff_step: int | None = key("first decode step whose token the reference would not choose (null: "
                                          "none)", "step")
        margin_at_first_diff: float | None = key("the reference's top-1/top-2 margin at that step", "logit")
        min_ref_margin: float = key("smallest top-1/top-2 margin of the reference over every step", "logit")
        equivalence_method: str = key("how it was checked: teacher_forced(n)+full_loop(m)")
        teacher_forced_prompts: int = key("prompts checked teacher-forced", "prompts")
        full_loop_prompts: int = key("prompts also checked against the true uncached loop", "prompts")
        full_loop_tokens_identical: bool | None = key("the true uncached loop chose the same tokens (null: not run)")
        full_prompts: int = key("the effective full_prompts", "prompts")
        equivalence_tol: float = key("the max |dlogit| an exact kind in fp32 may show (the verdict's tolerance)",
                                     "logit")
        sample_prompt: str = key("the first prompt, as text")
        sample_text: str = key("what the cache generated from it, as text")

    tables = (Table("drift", "drift.csv", on=("step",), columns=("step", "eq_max_abs_diff", "eq_top1_agreement"),
                    meaning="per decode step: max |dlogit| against the kind's reference, top-1 agreement"),)
    history = {"step/eq_max_abs_diff": "decode_step", "step/eq_top1_agreement": "decode_step"}

    @classmethod
    def check(cls, opts, max_len):
        from harness.common.errors import ConfigError
        from harness.measurements.base import MAX_PROMPTS

        tol = opts.equivalence_tol
        if not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and 0 < tol < float("inf")):
            raise ConfigError(f"equivalence_tol={tol!r} must be a positive number (max |dlogit| an exact kind in "
                              "fp32 may show), e.g. 1e-4")
        if opts.full_prompts is not None and opts.full_prompts < 0:
            raise ConfigError(f"full_prompts={opts.full_prompts} must be 0 or more (n_prompts caps it)")
        if opts.full_prompts is not None and opts.full_prompts > MAX_PROMPTS:
            raise ConfigError(f"full_prompts={opts.full_prompts} is over kvlab's cap of {MAX_PROMPTS:,} prompts: give "
                              f"0 .. {MAX_PROMPTS:,} (n_prompts caps it)")

    def __init__(self, ctx):
        super().__init__(ctx)
        n = len(ctx.prompts)
        full = self.opts.full_prompts
        self.full = min(n, full if full is not None else (1 if ctx.device.type == "cpu" else n))
        self.checks: list[dict] = []

    def on_generation(self, i, prompt, out):
        from harness.core import measure

        ctx = self.ctx
        reference = {**ctx.spec.reference, **measure.keep_reference(out)}
        eq = measure.equivalence_check(ctx.engine, prompt, out, reference)
        loop = measure.full_loop_check(ctx.engine, prompt, out, reference) if i < self.full else None
        self.checks.append(dict(tokens=out.tokens[0].tolist(), eq=eq["stats"], first_wrong=eq["first_wrong"],
                                loop=loop))

    def run(self):
        from harness.core import measure

        from models.tokenizer import Tokenizer

        summary, table = measure.equivalence_summary(self.checks, self.ctx.new_tokens)
        decode = self.ctx.decode or Tokenizer().decode  # the prompts' own tokenizer where the run has one
        text = dict(sample_prompt=decode(self.ctx.prompts[0][0].tolist()), sample_text=decode(self.checks[0]["tokens"]))
        return self.Result(**summary, full_prompts=self.full, equivalence_tol=float(self.opts.equivalence_tol),
                           **text), {"drift": table}

    @classmethod
    def not_equivalent(cls, r, tol):
        why = []
        if r.get("tokens_identical") is False:
            why.append(f"cached tokens differ from the reference's from step {r.get('first_diff_step')}")
        if r.get("max_abs_logit_diff") is not None and r["max_abs_logit_diff"] > tol:
            why.append(f"max |dlogit| {r['max_abs_logit_diff']:.3g} > equivalence_tol {tol:g}")
        return why

    @classmethod
    def summary(cls, r, tables):
        lossy = "  lossy kind: this is its error" if r.get("cache_exact") is False else ""
        return [f"  tokens identical  {r['tokens_identical']}  ({r['equivalence_method']}, {r['n_prompts']} prompts x "
                f"{r['new_tokens']} tokens){lossy}",
                f"  max |dlogit|      {r['max_abs_logit_diff']:.3g}  (cached vs the kind's uncached reference, same "
                "compute dtype)",
                f"  sample            {r['sample_prompt'][-40:]!r} -> {r['sample_text'][:40]!r}"]

    @classmethod
    def history_rows(cls, tables):
        return _per_step(tables.get("drift"), ("eq_max_abs_diff", "eq_top1_agreement"))


def _per_step(drift, columns) -> list[tuple[str, int, dict]]:
    """drift.csv's rows as W&B history against ``decode_step``: ``step/<column>`` for the given columns."""
    if drift is None:
        return []
    rows = []
    for row in drift.to_dict("records"):
        vals = {f"step/{c}": float(row[c]) for c in columns if c in row and row[c] == row[c]}  # NaN != NaN
        if vals:
            rows.append(("decode_step", int(row["step"]), vals))
    return rows
