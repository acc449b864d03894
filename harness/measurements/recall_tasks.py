"""Long-context retrieval tasks made offline: needles in a haystack of text (``niah``) and multi-query associative
recall (``mqar``), each through the run's cache beside fp32 full attention.

Each task is a set of probes (``harness.core.recall``): a context, then questions whose answers lie in it. The
context is prefilled into the run's cache and the questions go through it one decode step at a time, teacher-forced,
as the retrieval pass's second copy does; fp32 full attention (uncached) reads the same sequences. Only an answer's
ids are scored (top-1), each with where its source lies in the context (its depth: 0 the start, 1 just before the
questions), so accuracy reads by depth and, for ``niah``, by context length.

- ``niah`` (RULER's niah_single, and with ``niah_keys`` / ``niah_queries`` its multikey and multiquery forms):
  ``niah_k`` haystacks of the run's text (the prompts file: a shipped model's own held-out text; seeded random ids
  for a run without one) per context length; in each, at each of ``niah_depths`` depths, a needle (an 8-id key
  and an 8-id value of random ids) planted at that depth, ``niah_keys - 1`` more at random places that do not
  overlap, and the first ``niah_queries`` asked at the end, key then value.
- ``mqar`` (Arora et al., arXiv 2312.04927, Zoology's task): ``mqar_k`` sequences of ``mqar_pairs`` key-value pairs
  of random ids back to back (``mqar_key`` + ``mqar_value`` ids each; single ids by default, as Zoology's), then
  every key asked once in a random order, each followed by its value.

A task the model cannot do at full attention measures the model, not the cache: ``<task>_ref_ok`` says whether fp32
full attention answers at least ``REF_OK`` of it, and the summary says so where it does not. Neither task runs
unless named (``measurements=[...,niah,mqar]``): each adds passes of up to max_len tokens per probe.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Panel, Table, key, option, register

REF_OK = 0.5  # fp32 full attention must answer at least this share for the task to measure the cache
MAX_PROBES = 1_000  # niah_k x depths x lengths, or mqar_k: probes a run passes
POSITION_COLUMNS = ("context_len", "probe", "position", "depth", "depth_bucket", "seq_id", "correct", "correct_ref")


class RecallTask(Measurement):
    """What ``niah`` and ``mqar`` share: probes through the run's cache and fp32 full attention, scored per answer id
    with its depth. A subclass gives ``probes`` ([(context length, probe)]) and ``prefix`` (its keys' prefix)."""

    stage = "retrieval"
    optional = True
    prefix = ""

    def probes(self, ids) -> list:
        raise NotImplementedError

    def buckets(self) -> int:
        return 10

    @classmethod
    def pass_memory(cls, s, L: int, probes: int):
        """As the retrieval pass: B = ``text_rows`` probes of L tokens at a time (at most ``probes``), their cache,
        the pass's logits and the fp32 reference's forward."""
        from harness.core.measure import text_rows
        from harness.core.sizes import F32

        B = text_rows(L, s.model.vocab_size, probes)
        return [(cls.name, s.cache_at(B, L, cap=L), s.forward(B, L, L, F32) + 3 * B * L * s.model.vocab_size * F32)]

    def passed(self):
        """The probes through the cache and the reference: (the positions table, the probes)."""
        import pandas as pd

        from harness.core import copying, measure
        from harness.measurements.retrieval import Retrieval

        ctx = self.ctx
        ids = copying.distinct_ids(ctx.engine.model)
        if ctx.first_token is not None:
            ids = ids[ids != ctx.first_token]
        made = self.probes(ids)
        ref_engine = ctx.ref32 if ctx.ref32 is not None else ctx.engine
        rows, D = [], self.buckets()
        for asked in sorted({p.asked for _, p in made}):  # probes asked at one place share their passes
            group = [(i, L, p) for i, (L, p) in enumerate(made) if p.asked == asked]
            seqs = [p.seq.view(1, -1).to(ctx.device) for _, _, p in group]
            passes = Retrieval._passes(ctx, ref_engine, seqs, asked, f"the {self.name} pass")  # row t - 1: token t
            for (i, L, p), seq, (ours, ref) in zip(group, seqs, passes):
                at, target = [t - 1 for t in p.scored], seq[0, p.scored].cpu()
                hit, hit_ref = ((x[at].argmax(-1).cpu() == target).int().tolist() for x in (ours, ref))
                sid = measure.text_id(seq)
                rows += [dict(context_len=L, probe=i, position=t, depth=d, depth_bucket=min(int(d * D), D - 1),
                              seq_id=sid, correct=c, correct_ref=c_ref)
                         for t, d, c, c_ref in zip(p.scored, p.depths, hit, hit_ref)]
        return pd.DataFrame(rows, columns=list(POSITION_COLUMNS)), made

    def scores(self, table) -> dict:
        """The task's headline figures from its positions table: accuracy through the cache and through fp32 full
        attention, the lowest depth bucket's of each, the answer ids scored, and whether the reference can do it."""
        by = table.groupby("depth_bucket")[["correct", "correct_ref"]].mean()
        acc, ref = float(table.correct.mean()), float(table.correct_ref.mean())
        p = self.prefix
        return {f"{p}_acc": acc, f"{p}_acc_ref": ref, f"{p}_depth_min": float(by.correct.min()),
                f"{p}_depth_min_ref": float(by.correct_ref.min()), f"{p}_values": len(table),
                f"{p}_ref_ok": ref >= REF_OK}

    @classmethod
    def summary(cls, r, tables):
        p = cls.prefix
        if r.get(f"{p}_acc") is None:
            return []
        line = (f"  {cls.name:<17} {r[f'{p}_acc']:.1%} of {r[f'{p}_values']:,} answer ids right through the cache "
                f"(fp32 full attention: {r[f'{p}_acc_ref']:.1%}); lowest depth {r[f'{p}_depth_min']:.1%} "
                f"({r[f'{p}_depth_min_ref']:.1%})")
        if not r.get(f"{p}_ref_ok"):
            line += (f"; full attention itself answers under {REF_OK:.0%}: the task measures the model here, not "
                     "the cache")
        return [line]


def _check_count(name: str, value, low: int, high: int, what: str) -> None:
    from harness.common.errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must be an integer {low} .. {high:,} ({what})")


@register
class Niah(RecallTask):
    name = "niah"
    about = "needles in a haystack of the run's text (RULER's niah), by depth and context length, cache vs fp32"
    prefix = "niah"

    @dataclass(frozen=True)
    class Options:
        niah_lengths: list[int] | None = option(None, "context lengths: the positions a probe takes, its questions "
                                                      "and the model's first token included; None: max_len")
        niah_depths: int = option(10, "depths a needle is planted at: the middle of each of this many equal shares "
                                      "of the context before the questions")
        niah_k: int = option(4, "haystacks per context length (each holds a needle at every depth in turn)")
        niah_keys: int = option(1, "needles planted in each haystack (RULER's multikey: more than one)")
        niah_queries: int = option(1, "needles asked at the end, the first planted at the depth among them "
                                      "(multiquery: more than one)")

    @dataclass(frozen=True)
    class Result:
        niah_acc: float = key("top-1 accuracy on the asked needles' value ids, through the run's cache", "fraction",
                              shown=True, label="niah")
        niah_acc_ref: float = key("the same through fp32 full attention (uncached)", "fraction", shown=True,
                                  label="niah (fp32 full)")
        niah_depth_min: float = key("the lowest accuracy of any depth bucket, through the run's cache", "fraction")
        niah_depth_min_ref: float = key("the same through fp32 full attention", "fraction")
        niah_values: int = key("value ids scored", "ids")
        niah_ref_ok: bool = key(f"fp32 full attention answers at least {REF_OK:.0%}: below, the task measures the "
                                "model, not the cache")
        niah_lengths: str = key("the context lengths as run, comma-separated", "tokens")
        niah_depths: int = key("depths per haystack", "depths")
        niah_k: int = key("haystacks per context length (an interval's units)", "haystacks")
        niah_keys: int = key("needles planted per haystack", "needles")
        niah_queries: int = key("needles asked per haystack", "needles")

    tables = (Table("niah_positions", "niah_positions.csv", on=("context_len", "probe", "position"),
                    columns=POSITION_COLUMNS,
                    meaning="per asked value id of each needle probe: the context length, the probe, its position, "
                            "its needle's depth (0: the context's start, 1: just before the questions) and bucket, "
                            "seq_id (the haystack's tokens: what an interval resamples), and whether the run's top-1 "
                            "and fp32 full attention's are that id"),)
    panels = (Panel("Needle in a haystack", "bar", ("niah_acc", "niah_acc_ref"), ("cache_label", "dtype"),
                    "Top-1 accuracy on needles' values asked at the end of a haystack of text: through the cache, "
                    "and through fp32 full attention."),)

    @classmethod
    def check(cls, opts, max_len):
        from harness.common.errors import ConfigError
        from harness.core.recall import KEY, VALUE

        _check_count("niah_depths", opts.niah_depths, 1, 100, "depths")
        _check_count("niah_keys", opts.niah_keys, 1, 64, "needles planted")
        _check_count("niah_queries", opts.niah_queries, 1, opts.niah_keys, "needles asked, at most niah_keys")
        lengths = cls.lengths(opts, max_len)
        _check_count("niah_k", opts.niah_k, 1, MAX_PROBES // (opts.niah_depths * max(len(lengths), 1)),
                     "haystacks per length; niah_k x niah_depths x lengths at most "f"{MAX_PROBES:,}")
        need = (2 * opts.niah_keys + opts.niah_queries) * (KEY + VALUE) + 1
        for L in lengths:
            if isinstance(L, bool) or not isinstance(L, int) or not need <= L <= max_len:
                raise ConfigError(f"niah_lengths entry {L!r} must be {need} .. max_len {max_len} (room for "
                                  f"{opts.niah_keys} needle(s) apart and {opts.niah_queries} question(s))")
        if len(set(lengths)) < len(lengths):
            raise ConfigError(f"niah_lengths {lengths} names a length twice: give each once")

    @staticmethod
    def lengths(opts, max_len: int) -> list[int]:
        return sorted(opts.niah_lengths) if opts.niah_lengths is not None else [max_len]

    @classmethod
    def memory(cls, s, opts):
        return cls.pass_memory(s, max(cls.lengths(opts, s.max_len)), opts.niah_k)

    @classmethod
    def fills(cls, s, opts):
        return [("niah", 1, max(cls.lengths(opts, s.max_len)) - 1)]

    @classmethod
    def inputs(cls, opts, src, s):
        """``niah_k`` disjoint haystacks of the longest context from across the prompts file (or random ids)."""
        texts, _ = src.texts(opts.niah_k, max(cls.lengths(opts, s.max_len)))
        return dict(niah_haystacks=texts)

    def buckets(self) -> int:
        return self.opts.niah_depths

    def probes(self, ids) -> list:
        from harness.core.recall import haystack

        ctx, o = self.ctx, self.opts
        lead = int(ctx.first_token is not None)
        hays = [h.view(-1)[lead:].cpu() for h in ctx.inputs["niah_haystacks"]]  # without the first token, which
        # takes one of a probe's L positions
        made = []
        for L in self.lengths(o, ctx.max_len):
            for k, hay in enumerate(hays):
                for d in range(o.niah_depths):
                    depth = (d + 0.5) / o.niah_depths  # the middle of each depth's share of the context
                    made.append((L, haystack(hay[:L - lead], ids, depth, ctx.seed + 1_000 * k + d, o.niah_keys,
                                             o.niah_queries)))
        return made

    def run(self):
        table, made = self.passed()
        lengths = sorted({L for L, _ in made})
        return self.Result(**self.scores(table), niah_lengths=",".join(map(str, lengths)),
                           niah_depths=self.opts.niah_depths, niah_k=self.opts.niah_k, niah_keys=self.opts.niah_keys,
                           niah_queries=self.opts.niah_queries), {"niah_positions": table}


@register
class Mqar(RecallTask):
    name = "mqar"
    about = "multi-query associative recall (Zoology's MQAR): key-value pairs, then every key asked, cache vs fp32"
    prefix = "mqar"

    @dataclass(frozen=True)
    class Options:
        mqar_pairs: int | None = option(None, "key-value pairs per sequence; None: as many as fit in max_len "
                                              "(the pairs and their questions)")
        mqar_k: int = option(8, "sequences (an interval's units)")
        mqar_key: int = option(1, "ids per key (Zoology: 1)")
        mqar_value: int = option(1, "ids per value (Zoology: 1)")

    @dataclass(frozen=True)
    class Result:
        mqar_acc: float = key("top-1 accuracy on the values asked, through the run's cache", "fraction",
                              shown=True, label="mqar")
        mqar_acc_ref: float = key("the same through fp32 full attention (uncached)", "fraction", shown=True,
                                  label="mqar (fp32 full)")
        mqar_depth_min: float = key("the lowest accuracy of the 10 depth buckets (a pair's place among the pairs), "
                                    "through the run's cache", "fraction")
        mqar_depth_min_ref: float = key("the same through fp32 full attention", "fraction")
        mqar_values: int = key("value ids scored", "ids")
        mqar_ref_ok: bool = key(f"fp32 full attention answers at least {REF_OK:.0%}: below, the task measures the "
                                "model, not the cache")
        mqar_pairs: int = key("key-value pairs per sequence, as run", "pairs")
        mqar_k: int = key("sequences", "sequences")
        mqar_key: int = key("ids per key", "ids")
        mqar_value: int = key("ids per value", "ids")

    tables = (Table("mqar_positions", "mqar_positions.csv", on=("context_len", "probe", "position"),
                    columns=POSITION_COLUMNS,
                    meaning="per asked value id of each MQAR sequence: its length, the sequence, the position, its "
                            "pair's place among the pairs (depth 0 .. 1) and bucket, seq_id, and whether the run's "
                            "top-1 and fp32 full attention's are that id"),)
    panels = (Panel("Multi-query associative recall", "bar", ("mqar_acc", "mqar_acc_ref"), ("cache_label", "dtype"),
                    "Top-1 accuracy on the values of key-value pairs asked again: through the cache, and through "
                    "fp32 full attention."),)

    @classmethod
    def check(cls, opts, max_len):
        _check_count("mqar_k", opts.mqar_k, 1, MAX_PROBES, "sequences")
        _check_count("mqar_key", opts.mqar_key, 1, 64, "ids per key")
        _check_count("mqar_value", opts.mqar_value, 1, 64, "ids per value")
        from harness.common.errors import ConfigError

        span = opts.mqar_key + opts.mqar_value
        most = (max_len - 1) // (2 * span)  # the first token may take a position
        if most < 1:
            raise ConfigError(f"mqar needs max_len >= {2 * span + 1} (one pair of {span} ids and its question, and "
                              f"the first token), got {max_len}: raise max_len or leave mqar out of measurements")
        if opts.mqar_pairs is not None:
            _check_count("mqar_pairs", opts.mqar_pairs, 1, most, f"pairs: twice their {span} ids fit in max_len "
                         f"{max_len} less the first token")

    @staticmethod
    def pairs(opts, max_len: int) -> int:
        return opts.mqar_pairs or (max_len - 1) // (2 * (opts.mqar_key + opts.mqar_value))

    @classmethod
    def seq_len(cls, s, opts) -> int:
        return 2 * cls.pairs(opts, s.max_len) * (opts.mqar_key + opts.mqar_value) + 1

    @classmethod
    def memory(cls, s, opts):
        return cls.pass_memory(s, cls.seq_len(s, opts), opts.mqar_k)

    @classmethod
    def fills(cls, s, opts):
        return [("mqar", 1, cls.seq_len(s, opts) - 1)]

    def probes(self, ids) -> list:
        from harness.core.recall import mqar

        o, seed = self.opts, self.ctx.seed
        n = self.pairs(o, self.ctx.max_len)
        lead = int(self.ctx.first_token is not None)
        return [(2 * n * (o.mqar_key + o.mqar_value) + lead, mqar(ids, n, seed + i, o.mqar_key, o.mqar_value))
                for i in range(o.mqar_k)]

    def run(self):
        table, made = self.passed()
        o = self.opts
        return self.Result(**self.scores(table), mqar_pairs=self.pairs(o, self.ctx.max_len), mqar_k=o.mqar_k,
                           mqar_key=o.mqar_key, mqar_value=o.mqar_value), {"mqar_positions": table}
