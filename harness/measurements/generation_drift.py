"""Generation drift: the run's cached generations against FP32 full attention, and why their tokens first part."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import shown, Measurement, Panel, Table, key, register
from harness.measurements.equivalence import _per_step

DRIFT_COLUMNS = ("drift_max_abs", "drift_mean_abs", "drift_kl", "drift_top1_agreement")


@register
class GenerationDrift(Measurement):
    name = "generation_drift"
    about = "the cached generations' logits and tokens against fp32 full attention (reduced precision, lossy kinds)"
    reads_generations = True
    stage = "equivalence and drift"

    @dataclass(frozen=True)
    class Result:
        drift_reference: str = key("what drift is measured against")
        drift_max_abs: float = key("max |logit - fp32's| over every prompt and step (fp32 teacher-forced on the "
                                   "same tokens)", "logit")
        drift_mean_abs: float = key("mean |logit - fp32's|", "logit")
        drift_gen_kl: float = key("mean KL(fp32 || run) over the generated steps", "nats")
        drift_top1_agreement: float = key("share of steps whose top-1 token is fp32's", "fraction")
        drift_token_match_rate: float = key("share of generated tokens equal to fp32's own greedy tokens",
                                            "fraction", shown=True)
        drift_first_divergence_step: int | None = key("first step the tokens leave fp32's (null: never)", "step")
        drift_margin_at_divergence: float | None = key("fp32's top-1/top-2 margin at that step", "logit")
        drift_near_tie: bool | None = key("that margin is within twice the run's usual max |dlogit|: a near tie "
                                          "flipped, not a bug")
        drift_divergence_layer: int | None = key("first layer whose K or V, read at that step, is off fp32's by "
                                                 "more than the layer tolerance", "layer")
        drift_divergence_diagnosis: str | None = key("one line: why the tokens parted")

    tables = (Table("drift", "drift.csv", on=("step",), columns=("step", *DRIFT_COLUMNS),
                    meaning="per decode step: drift against fp32 full attention (NaN without drift)"),)
    history = {f"step/{c}": "decode_step" for c in DRIFT_COLUMNS}
    panels = (Panel("Drift vs decode step, by dtype", "line", ("step/drift_kl", "step/drift_max_abs"), ("dtype",),
                    "Drift from fp32 full attention per decode step: KL and max |Δlogit|.", "decode_step",
                    False, True),
              Panel("Drift vs decode step, by cache kind", "line", ("step/drift_kl", "step/drift_max_abs"),
                    ("cache",), "The same drift, grouped by cache kind.", "decode_step", False, True))

    def __init__(self, ctx):
        super().__init__(ctx)
        self.checks: list[dict] = []

    def skip(self):
        if self.ctx.ref32 is None:
            return "an exact kind in fp32 storage and compute is its own fp32 reference: nothing to drift from"
        return None

    def on_generation(self, i, prompt, out):
        from harness.core import measure

        self.checks.append(dict(prompt=prompt, tokens=out.tokens[0].tolist(),
                                drift=measure.drift_check(self.ctx.ref32, prompt, out)))

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        summary, table = measure.drift_summary_of(self.checks, ctx.new_tokens)
        summary.update(drift_margin_at_divergence=None, drift_near_tie=None, drift_divergence_layer=None,
                       drift_divergence_diagnosis=None)
        diverged = [(c["drift"]["first_divergence"], i) for i, c in enumerate(self.checks)
                    if c["drift"]["first_divergence"] is not None]
        if diverged:
            step, i = min(diverged)
            stats = self.checks[i]["drift"]["stats"]
            # the run's usual drift: before the divergence (the step itself must flip the tokens, so its own
            # drift is at least half the margin by construction)
            usual = float(stats["max_abs"][:step].median()) if step > 0 else float(stats["max_abs"][0])
            summary.update(measure.diagnose_divergence(ctx.engine, ctx.ref32, ctx.spec, self.checks[i]["prompt"],
                                                       self.checks[i]["tokens"], step,
                                                       float(stats["ref_margin"][step]), usual))
        return (self.Result(drift_reference="fp32 full attention (uncached)", **summary),
                {"drift": table.assign(step=range(ctx.new_tokens))[["step", *DRIFT_COLUMNS]]})

    @classmethod
    def summary(cls, r, tables):
        why = f" · {r['drift_divergence_diagnosis']}" if r.get("drift_divergence_diagnosis") else ""
        return [f"  drift vs fp32     generation: max |d| {shown(r['drift_max_abs'], '.3g')} · top-1 "
                f"{shown(r['drift_top1_agreement'], '.1%')} · token match "
                f"{shown(r['drift_token_match_rate'], '.1%')}{why}"]

    @classmethod
    def history_rows(cls, tables):
        return _per_step(tables.get("drift"), DRIFT_COLUMNS)
