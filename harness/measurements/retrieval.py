"""Retrieval: can the model copy what it has seen, through the run's cache? Random sequences shown twice.

What windows and eviction break and KL on prose hides: k random sequences of n tokens, each followed by itself,
go through the cache as inference runs them (the first copy prefilled, the second teacher-forced one decode step at
a time); ``retrieval_acc`` is the top-1 accuracy on the second copy. ``retrieval_acc_ref`` is the same through fp32
full attention (uncached), and ``retrieval_first_copy_acc`` the accuracy on the first copy (chance: nothing to copy
yet). The tokens are drawn from those the model can tell apart: ids whose embedding row no other id shares (a
trained checkpoint that ties every unused id to one row, as kvlab's mini does, copies none of those).

**By depth** (``retrieval_depth.csv``, the report's ``retrieval_depth`` heatmap): where in the context the copied
token sits, the needle-in-a-haystack picture. In the pass above every token of the second copy copies the one n
tokens back, so its source's distance never changes and a window either holds all of them or none. The depth view
is a pass of its own per sequence and context length L: a context of L random ids (prefilled), then from each of
``retrieval_depth_buckets`` equal depth buckets of it one span of 8 tokens at a random place (fewer when a bucket
holds fewer), asked newest bucket first, teacher-forced one decode step at a time as the second copy is. Each span's
first token is fed unscored (nothing announces which span comes); each later token is scored, with its source's
depth = source position / L (0 = the start of the context, 1 = its end) and its distance = how many tokens before
the newest one the source sits. A window of W slots and S sinks holds a source at distance < W or at a position
< S, so at length L it reaches the depths above about 1 - W/L and loses everything older: across lengths the lost
cells form the triangle a needle-in-a-haystack chart shows; an evicting kind loses the depths its policy drops. fp32
full attention on the same sequences (``correct_ref``) says what the model copies with nothing lost.

Why a pass of its own and these defaults: it costs little beside the pass above and reads as a needle-in-a-haystack
chart does (depth across, context length up the side), where reading depth off the pass above would show no
window's edge. By default one length, L = n, and k sequences: a prefill and 5 x 8 - 1 decode steps each, about a
sixth of the pass above on GPT-2 small and a third on the mini (whose decode steps are cheap beside a prefill); a
cell then holds k x 7 copied tokens. ``retrieval_depth_lengths`` adds lengths (k sequences each; each pass within
the 2n tokens of the pass above, which the memory check and a paged pool are sized by), and
``retrieval_depth_buckets=0`` leaves the view out. The context's ids are distinct, so each copied token has one
source.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Panel, Table, key, option, register

MAX_SEQUENCES = 1_000  # retrieval_k's cap: each sequence is a pass of 2 * retrieval_n tokens
MAX_BUCKETS = 20  # retrieval_depth_buckets' cap
DEPTH_COLUMNS = ("context_len", "sequence", "position", "source", "depth", "depth_bucket", "buckets", "distance",
                 "seq_id", "correct", "correct_ref")


@register
class Retrieval(Measurement):
    name = "retrieval"
    about = "copy accuracy on random sequences shown twice, through the run's cache vs fp32 full attention"
    stage = "retrieval"
    @classmethod
    def memory(cls, s, opts):
        """Sequences of L = 2 min(retrieval_n, max_len // 2) tokens, B = ``text_rows`` at a time (at most
        retrieval_k): a cache of B x L tokens, its pass's logits (B, L - 1, V) in one buffer, and the fp32
        reference's forward over (B, L) keeping every position's logits."""
        from harness.core.measure import text_rows
        from harness.core.sizes import F32

        L = cls.seq_len(s, opts)
        B = text_rows(L, s.model.vocab_size, opts.retrieval_k)
        return [("retrieval", s.cache_at(B, L, cap=L), s.forward(B, L, L, F32) + 3 * B * L * s.model.vocab_size * F32)]

    @classmethod
    def fills(cls, s, opts):
        return [("retrieval", 1, cls.seq_len(s, opts) - 1)]

    @staticmethod
    def seq_len(s, opts) -> int:
        """A retrieval sequence: its span twice, each at most half the capacity."""
        return 2 * min(opts.retrieval_n, s.max_len // 2)

    @dataclass(frozen=True)
    class Options:
        retrieval_n: int = option(200, "tokens per random sequence (each shown twice; clamped to max_len / 2)")
        retrieval_k: int = option(2, "random sequences")
        retrieval_depth_buckets: int = option(5, "depth buckets of the depth view (retrieval_depth.csv): one span "
                                                 "asked from each; 0: no depth view")
        retrieval_depth_lengths: list[int] | None = option(None, "context lengths of the depth view (tokens before "
                                                               "the spans are asked); None: retrieval_n as run")

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
        retrieval_depth_acc: float | None = key("top-1 accuracy on the depth view's copied spans, every depth and "
                                                "length, through the run's cache (null: no depth view)", "fraction")
        retrieval_depth_acc_ref: float | None = key("the same through fp32 full attention (uncached)", "fraction")
        retrieval_depth_buckets: int = key("depth buckets of the depth view, as asked (0: none)", "buckets")
        retrieval_depth_lengths: str | None = key("the depth view's context lengths, comma-separated (null: no depth "
                                                  "view: retrieval_depth_buckets=0, or sequences shorter than 2 "
                                                  "tokens a bucket)", "tokens")

    tables = (Table("retrieval_positions", "retrieval_positions.csv", on=("sequence", "position"),
                    columns=("sequence", "position", "seq_id", "correct", "correct_ref"),
                    meaning="per token of each sequence's second copy: whether the run's top-1 is that token, and "
                            "fp32 full attention's; seq_id names the sequence by its tokens (what an interval over "
                            "sequences resamples)"),
              Table("retrieval_depth", "retrieval_depth.csv", on=("context_len", "sequence", "position"),
                    columns=DEPTH_COLUMNS,
                    meaning="per copied token of the depth view (spans of a context of context_len random tokens, "
                            "asked after it): its source's position, depth (source / context_len: 0 the start, 1 "
                            "the end) and bucket of buckets, distance (tokens between the source and the newest "
                            "token), and whether the run's top-1 and fp32 full attention's are that token"),)
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
        cls._check_depth(opts, min(opts.retrieval_n, max_len // 2))

    @classmethod
    def _check_depth(cls, opts, n: int) -> None:
        """The depth view's options: buckets 0 .. MAX_BUCKETS; each length distinct, with 2 tokens a bucket, and its
        pass (the context and a span per bucket) within the 2n tokens of the copy pass."""
        from harness.common.errors import ConfigError
        from harness.core.copying import depth_span
        from harness.measurements.base import MAX_LIST

        D, lengths = opts.retrieval_depth_buckets, opts.retrieval_depth_lengths
        if isinstance(D, bool) or not isinstance(D, int) or not 0 <= D <= MAX_BUCKETS:
            raise ConfigError(f"retrieval_depth_buckets={D!r} must be an integer 0 .. {MAX_BUCKETS} (0: no depth view)")
        if lengths is None:
            return
        lengths = list(lengths)
        if not lengths or len(lengths) > MAX_LIST:
            raise ConfigError(f"retrieval_depth_lengths has {len(lengths)} entries: give 1 .. {MAX_LIST} (or null: "
                              "retrieval_n as run)")
        if D == 0:
            raise ConfigError("retrieval_depth_lengths needs retrieval_depth_buckets >= 1 (0 leaves the depth view "
                              "out)")
        for L in lengths:
            if isinstance(L, bool) or not isinstance(L, int) or L < 2 * D:
                raise ConfigError(f"retrieval_depth_lengths entry {L!r} is too short for {D} depth buckets: give at "
                                  f"least {2 * D} tokens (2 a bucket)")
            if L + D * depth_span(L, D) > 2 * n:
                longest = _longest(n, D)
                fix = f"give at most {longest} or raise retrieval_n" if longest else "raise retrieval_n"
                raise ConfigError(f"retrieval_depth_lengths entry {L} takes a pass of {L + D * depth_span(L, D)} "
                                  f"tokens, over the {2 * n} of the retrieval pass (2 x retrieval_n {n}, as run): "
                                  f"{fix}")
        if len(set(lengths)) < len(lengths):
            raise ConfigError(f"retrieval_depth_lengths {lengths} names a length twice: give each once")

    def depth_lengths(self, n: int) -> list[int]:
        """The depth view's context lengths: as asked, or n (the copy pass's sequences); [] for none (no buckets,
        or n too short for them)."""
        from harness.core.copying import depth_span

        D = self.opts.retrieval_depth_buckets
        if D == 0:
            return []
        if self.opts.retrieval_depth_lengths is not None:
            return sorted(self.opts.retrieval_depth_lengths)
        return [n] if depth_span(n, D) >= 2 else []

    def run(self):
        from harness.core import measure
        from harness.core import copying
        import pandas as pd

        ctx = self.ctx
        lead = int(ctx.first_token is not None)  # a model trained with a fixed first token sees it first
        n = min(self.opts.retrieval_n, (ctx.max_len - lead) // 2)
        if lead:  # the depth lengths were checked against max_len // 2: the first token takes one position more
            self._check_depth(self.opts, n)
        ids = copying.distinct_ids(ctx.engine.model)
        if lead:
            ids = ids[ids != ctx.first_token]
        ref_engine = ctx.ref32 if ctx.ref32 is not None else ctx.engine
        accs, refs, firsts, rows = [], [], [], []
        seqs = [seq.to(ctx.device) for seq in copying.copy_sequences(ids, n, self.opts.retrieval_k, ctx.seed)]
        for i, (seq, (ours, ref)) in enumerate(zip(seqs, self._passes(ctx, ref_engine, seqs, n,
                                                                      "the retrieval pass"))):  # (2n - 1, vocab)
            (a, f), (r, _) = copying.copy_accuracy(ours, seq, n), copying.copy_accuracy(ref, seq, n)
            accs.append(a), refs.append(r), firsts.append(f)
            target = seq[0, n:].cpu()  # the second copy, predicted by rows n - 1 .. 2n - 2
            hit, hit_ref = ((x[n - 1:].argmax(-1).cpu() == target).int().tolist() for x in (ours, ref))
            sid = measure.text_id(seq)
            rows += [dict(sequence=i, position=j, seq_id=sid, correct=c, correct_ref=c_ref)
                     for j, (c, c_ref) in enumerate(zip(hit, hit_ref))]
        mean = lambda xs: float(sum(xs) / len(xs))  # noqa: E731
        table = pd.DataFrame(rows, columns=list(self.tables[0].columns))
        lengths = self.depth_lengths(n)
        depth = self._depth(ids, ref_engine, lengths)
        return self.Result(retrieval_acc=mean(accs), retrieval_acc_ref=mean(refs),
                           retrieval_first_copy_acc=mean(firsts), retrieval_n=n, retrieval_k=self.opts.retrieval_k,
                           retrieval_vocab=len(ids),
                           retrieval_depth_acc=float(depth.correct.mean()) if len(depth) else None,
                           retrieval_depth_acc_ref=float(depth.correct_ref.mean()) if len(depth) else None,
                           retrieval_depth_buckets=self.opts.retrieval_depth_buckets,
                           retrieval_depth_lengths=",".join(map(str, lengths)) or None), \
            {"retrieval_positions": table, "retrieval_depth": depth}

    def _depth(self, ids, ref_engine, lengths: list[int]):
        """The depth view's rows (``DEPTH_COLUMNS``): k sequences per context length (``copying.depth_sequences``),
        each through the run's cache (the context prefilled, the spans one decode step at a time) and through fp32
        full attention."""
        from harness.core import copying, measure
        import pandas as pd

        ctx, D, rows = self.ctx, self.opts.retrieval_depth_buckets, []
        for L in lengths:
            made = copying.depth_sequences(ids, L, D, self.opts.retrieval_k, ctx.seed)
            seqs = [p.seq.to(ctx.device) for p in made]
            passes = self._passes(ctx, ref_engine, seqs, L, "the retrieval depth pass")  # row t - 1: token t
            for i, (p, seq, (ours, ref)) in enumerate(zip(made, seqs, passes)):
                at, target = [t - 1 for t in p.positions], seq[0, p.positions].cpu()
                hit, hit_ref = ((x[at].argmax(-1).cpu() == target).int().tolist() for x in (ours, ref))
                sid = measure.text_id(seq)
                rows += [dict(context_len=L, sequence=i, position=t, source=s, depth=s / L, depth_bucket=s * D // L,
                              buckets=D, distance=t - 1 - s, seq_id=sid, correct=c, correct_ref=c_ref)
                         for t, s, c, c_ref in zip(p.positions, p.sources, hit, hit_ref)]
        return pd.DataFrame(rows, columns=list(DEPTH_COLUMNS))

    @staticmethod
    def _passes(ctx, ref_engine, seqs: list, prefill: int, what: str):
        """Each sequence (1, T) through the run's cache (its first ``prefill`` tokens prefilled, the rest decoded)
        and through fp32 full attention, several at once as the rows of one cache (``measure.text_pass_rows``):
        per sequence, in order, the logits that predicted its tokens 1 .. T - 1, (T - 1, vocab) each. A model
        trained with a fixed first token gets it in front (``ctx.first_token``); its own row is dropped."""
        import torch

        from harness.core import measure

        lead = int(ctx.first_token is not None)
        if lead:
            seqs = [torch.cat([seq.new_full((1, 1), ctx.first_token), seq], 1) for seq in seqs]
        for group in measure.text_batches(seqs, measure.engine_vocab(ctx.engine), ctx.spec.rows_at_once()):
            rows = torch.cat([seqs[i] for i in group])
            ours, _ = measure.text_pass_rows(ctx.engine, ctx.spec, rows, prefill + lead)
            measure.check_finite(ours, what)
            ref = ref_engine.forward(rows)[:, :-1].float()  # fp32 full attention, uncached
            for b in range(len(group)):
                yield ours[b, lead:], ref[b, lead:]

    @classmethod
    def summary(cls, r, tables):
        lines = [f"  retrieval         {r['retrieval_acc']:.1%} of the second copy right through the cache "
                 f"(fp32 full attention: {r['retrieval_acc_ref']:.1%}; first copy {r['retrieval_first_copy_acc']:.1%}"
                 f"; {r['retrieval_k']} x {r['retrieval_n']} random tokens shown twice)"]
        return lines + depth_lines(r, tables.get("retrieval_depth"))


def _longest(n: int, buckets: int) -> int:
    """The longest context whose depth pass (the context and a span per bucket) fits in 2n tokens."""
    from harness.core.copying import depth_span

    return max((L for L in range(2 * buckets, 2 * n + 1) if L + buckets * depth_span(L, buckets) <= 2 * n),
               default=0)


def depth_lines(r: dict, depth) -> list[str]:
    """The summary's depth lines: per context length, the accuracy in each depth bucket, oldest first, through the
    cache and (in brackets) through fp32 full attention; or why there is no depth view."""
    D = r.get("retrieval_depth_buckets")
    if not D:
        return []
    if depth is None or not len(depth):
        return [f"  retrieval depth   not measured: the {r['retrieval_n']}-token sequences are too short for {D} depth "
                f"buckets (2 tokens a bucket; retrieval_depth_buckets, retrieval_depth_lengths)"]
    rows = []
    for L, g in depth.groupby("context_len"):
        by = g.groupby("depth_bucket")[["correct", "correct_ref"]].mean().reindex(range(D))
        rows.append((int(L), *(" ".join(f"{chr(8212):^4}" if v != v else f"{v:.2f}" for v in by[c])
                               for c in ("correct", "correct_ref"))))
    head = f"  retrieval depth   by the source's depth in the context, start -> end in {D} buckets"
    if len(rows) == 1:
        L, cells, refs = rows[0]
        return [f"{head}, context {L}: {cells} (fp32 full attention: {refs})"]
    w = len(str(max(L for L, _, _ in rows)))
    return [f"{head} (fp32 full attention in brackets):"] + [f"{' ' * 20}context {L:>{w}}: {cells}  ({refs})"
                                                               for L, cells, refs in rows]
