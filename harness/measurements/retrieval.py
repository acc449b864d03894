"""Retrieval: can the model copy what it has seen, through the run's cache? Random sequences shown twice.

What windows and eviction break and KL on prose hides: k random sequences of n tokens, each followed by itself,
go through the cache as inference runs them (the first copy prefilled, the second teacher-forced one decode step at
a time); ``retrieval_acc`` is the top-1 accuracy on the second copy. ``retrieval_acc_ref`` is the same through fp32
full attention (uncached), and ``retrieval_first_copy_acc`` the accuracy on the first copy (chance: nothing to copy
yet). The tokens are drawn from those the model can tell apart: ids whose embedding row no other id shares (a
trained checkpoint that ties every unused id to one row, as kvlab's mini does, copies none of those).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Panel, Table, key, option, register

MAX_SEQUENCES = 1_000  # retrieval_k's cap: each sequence is a pass of 2 * retrieval_n tokens


@register
class Retrieval(Measurement):
    name = "retrieval"
    about = "copy accuracy on random sequences shown twice, through the run's cache vs fp32 full attention"
    stage = "retrieval"
    memory_phases = ("retrieval",)

    @dataclass(frozen=True)
    class Options:
        retrieval_n: int = option(200, "tokens per random sequence (each shown twice; clamped to max_len / 2)")
        retrieval_k: int = option(2, "random sequences")

    @dataclass(frozen=True)
    class Result:
        retrieval_acc: float = key("top-1 accuracy on the second copy, through the run's cache, dtype and engine",
                                   "fraction", shown=True, label="retrieval")
        retrieval_acc_ref: float = key("the same through fp32 full attention (uncached)", "fraction", shown=True,
                                       label="retrieval (fp32 full)")
        retrieval_first_copy_acc: float | None = key("top-1 accuracy on the first copy (nothing to copy yet)",
                                                     "fraction")
        retrieval_n: int = key("tokens per sequence, as run (after the clamp)", "tokens")
        retrieval_k: int = key("sequences", "sequences")
        retrieval_vocab: int = key("token ids the sequences were drawn from (distinct embedding rows)", "ids")

    tables = (Table("retrieval_positions", "retrieval_positions.csv", on=("sequence", "position"),
                    columns=("sequence", "position", "seq_id", "correct", "correct_ref"),
                    meaning="per token of each sequence's second copy: whether the run's top-1 is that token, and "
                            "fp32 full attention's; seq_id names the sequence by its tokens (what an interval over "
                            "sequences resamples)"),)
    panels = (Panel("Retrieval: copy accuracy", "bar", ("retrieval_acc", "retrieval_acc_ref"), ("cache_label", "dtype"),
                    "Top-1 accuracy on the second copy of random sequences shown twice: through the cache, and "
                    "through fp32 full attention."),)

    @classmethod
    def check(cls, opts, max_len):
        from harness.common.errors import ConfigError

        if opts.retrieval_n < 2:
            raise ConfigError(f"retrieval_n={opts.retrieval_n} must be at least 2 (tokens per sequence)")
        if opts.retrieval_k < 1:
            raise ConfigError(f"retrieval_k={opts.retrieval_k} must be at least 1 (sequences)")
        if opts.retrieval_k > MAX_SEQUENCES:
            raise ConfigError(f"retrieval_k={opts.retrieval_k} is over kvlab's cap of {MAX_SEQUENCES:,} sequences: "
                              f"give 1 .. {MAX_SEQUENCES:,}")
        if max_len < 4:
            raise ConfigError(f"retrieval needs max_len >= 4 (two copies of 2 tokens), got {max_len}: raise max_len "
                              "or leave retrieval out of measurements")

    def run(self):
        from harness.core import measure
        from harness.core import copying
        import pandas as pd

        ctx = self.ctx
        n = min(self.opts.retrieval_n, ctx.max_len // 2)
        ids = copying.distinct_ids(ctx.engine.model)
        ref_engine = ctx.ref32 if ctx.ref32 is not None else ctx.engine
        accs, refs, firsts, rows = [], [], [], []
        for i, seq in enumerate(copying.copy_sequences(ids, n, self.opts.retrieval_k, ctx.seed)):
            seq = seq.to(ctx.device)
            ours, _ = measure.text_pass(ctx.engine, ctx.spec, seq, n)  # (2n - 1, vocab)
            measure.check_finite(ours, "the retrieval pass")
            ref = ref_engine.forward(seq)[0, :-1].float()  # fp32 full attention, uncached
            (a, f), (r, _) = copying.copy_accuracy(ours, seq, n), copying.copy_accuracy(ref, seq, n)
            accs.append(a), refs.append(r), firsts.append(f)
            target = seq[0, n:].cpu()  # the second copy, predicted by rows n - 1 .. 2n - 2
            hit, hit_ref = ((x[n - 1:].argmax(-1).cpu() == target).int().tolist() for x in (ours, ref))
            sid = measure.text_id(seq)
            rows += [dict(sequence=i, position=j, seq_id=sid, correct=c, correct_ref=c_ref)
                     for j, (c, c_ref) in enumerate(zip(hit, hit_ref))]
        mean = lambda xs: float(sum(xs) / len(xs))  # noqa: E731
        table = pd.DataFrame(rows, columns=list(self.tables[0].columns))
        return self.Result(retrieval_acc=mean(accs), retrieval_acc_ref=mean(refs),
                           retrieval_first_copy_acc=mean(firsts), retrieval_n=n, retrieval_k=self.opts.retrieval_k,
                           retrieval_vocab=len(ids)), {"retrieval_positions": table}

    @classmethod
    def summary(cls, r, tables):
        return [f"  retrieval         {r['retrieval_acc']:.1%} of the second copy right through the cache "
                f"(fp32 full attention: {r['retrieval_acc_ref']:.1%}; first copy {r['retrieval_first_copy_acc']:.1%}"
                f"; {r['retrieval_k']} x {r['retrieval_n']} random tokens shown twice)"]
