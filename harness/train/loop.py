"""Training: check the settings and --out, report a finished run, resume or start one, train, export, record.

AdamW, linear warmup then cosine decay scheduled on the fraction of the budget used (steps for --steps, wall clock
for --minutes), batches from a seeded generator: the same --steps command gives the same model on any machine load
(bit for bit with the same torch and --threads; another thread count sums in another order, which moves the weights
by float rounding). ``threads`` (default: every core) is only about speed: one thread beats two on a machine whose
other core is busy, since two threads then wait on each other.

While training, DIR/train_state.pt (model, optimiser, step, elapsed time, RNG; tensors and plain values only) is saved
every minute: the same command resumes it (a state that is malformed, too big or of a step outside the run's budget:
one line, exit 2); ``restart`` starts over. A finished folder is reported and left alone. ``--out`` must be writable
and kvlab's (``harness.train.folder``: its manifest, or a run from before manifests, proven): both are checked (one
line, exit 2) before anything there is written or deleted and before any data is loaded; ``restart`` removes only
the files the manifest lists.

Stopping (``harness.common.signals``, the one stop-signal protocol): SIGINT (Ctrl-C), SIGTERM (Slurm's pre-emption),
SIGUSR2 (submitit's) and SIGHUP all stop it the same way. Once the model exists, the step in progress finishes,
DIR/train_state.pt is saved at that step (signals held off while it is written, so it is the old file or the new one,
never half of one) and one line on stderr says the signal, the path and the step; the same command resumes from it.
Stopped before the first step, nothing is saved and the line says the same command starts over; stopped while the
finished model is evaluated and exported, the state at the last step is saved and the same command writes the
checkpoint. A second signal stops at once (the line then names the state saved earlier, if any). Exit code 128 + the
signal's number (130, 143, 140, 129).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.common.ownership import NotOurs, atomic_write, claim, remove
from harness.common.signals import Interrupted, Stop, blocked, signal_name
from harness.core.copying import model_copy_accuracy
from harness.train.corpus import TrainingData
from harness.train.export import export_full, finished, write_checkpoint
from harness.train.folder import RESTART, check_out, fit_problem, load_state, state_cap, step_problem, take
from harness.train.model import (attention_only_at, compact_model, hidden, lr_at, make_optimizer, mlp_output,
                                 mlps_left_out, pin_embedding, row_positions)
from harness.train.recipe import (BATCH, BOS, COPY_OFFSETS, COPY_PHASE, COPY_SHARE, CORPUS, DEEP_DRAW, DEFAULT_STEPS,
                                  EOT, EVAL_LEN, FAMILY_PRESETS, FAR_SHARE, FAR_SPAN_MAX, HELDOUT_AT, HELDOUT_EVERY,
                                  IGNORE, INIT_STD, MAX_STEPS, MIN_LR_FRAC, MLP_OFF, OURS, PEAK_LR, PLACED_SHARE,
                                  NEEDLE_SHARE, OFFSET_DRAW, QUESTION_TAIL, QUICK_COPY, QUICK_FAR, SEQ_LEN, TEXT_SPANS,
                                  SINK_FROM, SPAN_MIN, STATE, WARMUP_FRAC, WEIGHT_DECAY, TrainError, check_settings,
                                  curriculum_setting)
from harness.train.rows import DEEP_DRAWS, OFFSET_DRAWS, make_batch, offset_starts, twice_rows, with_bos
from harness.train.targets import attention_on_first, evaluate, nll, prompts_nll, targets_table
from models.decoder import Decoder
from models.families import preset_config


class _Progress:
    """What a stopped ``train`` has on disk, for the one line it ends with."""

    def __init__(self, folder: Path, restart: bool):
        self.folder, self.restart = folder, restart
        self.state_step: int | None = None  # step of the training state in the folder (this run's or the one resumed)
        self.saved_now = False  # whether this stop saved it
        self.step: int | None = None  # steps trained so far (this run and the one resumed), once training started
        self.budget = ""  # "of 40 steps" / "of the 12-minute budget"
        self.save = None  # once training is over: saves the state at its last step (the stop then saves it)
        self.complete = False  # the checkpoint is written
        self.bar = None

    def message(self, signum: int) -> str:
        name, path = signal_name(signum), self.folder / STATE
        same = "the same command without --restart" if self.restart else "the same command"  # --restart discards it
        if self.complete:
            return (f"{name} after the checkpoint was written: {self.folder} is complete ({self.step} steps); the "
                    "same command reports it")
        if self.state_step is not None and self.saved_now:
            what = (f"training had reached its budget; {same} evaluates and writes the checkpoint from it"
                    if self.save is not None else f"{same} resumes from it")
            return f"{name}: saved {path} at step {self.state_step} {self.budget}; {what}"
        if self.state_step is not None:
            at = f" at step {self.step}" if self.step is not None else ""
            return (f"{name}: stopped{at} at once, nothing new saved; {path} (step {self.state_step}, saved "
                    f"earlier) is kept and {same} resumes from step {self.state_step}")
        if not self.restart and (self.folder / STATE).is_file():  # stopped before the state was even read
            return (f"{name}: stopped before training started, nothing new saved; {path} from an earlier run is "
                    "untouched")
        if self.step:
            return (f"{name}: stopped at once at step {self.step}, before any state was saved; nothing was saved, so "
                    "the same command starts over")
        return (f"{name}: stopped before the first step was saved; nothing was saved yet, so the same command starts "
                "over")


# ---- the output folder ----------------------------------------------------------------------------------------------

def _check_writable(folder: Path) -> None:
    """Refuse (TrainError) a ``--out`` that cannot be written, before anything is loaded: create the missing folders
    and a probe file, remove the probe; on failure remove the folders this made."""
    missing, p = [], folder
    try:
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        if not p.is_dir():
            raise TrainError(f"--out {folder}: {p} is a file, so no folder can be made under it; give a folder path")
    except OSError as e:
        raise TrainError(f"--out {folder}: cannot use it ({e.strerror or e}); give a folder you can write to") from None
    made = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        probe = folder / f".kvlab-write-test-{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        where = f"{e.filename}: " if e.filename else ""
        raise TrainError(f"--out {folder}: cannot write there ({where}{e.strerror or e}); give a folder you can "
                         "write to") from None


def _read_state(folder: Path, settings: dict, restart: bool, status: _Progress, owner: str, state: dict | None,
                cap: int) -> dict | None:
    """The partial run to resume (None: start afresh), its step inside the run's budget; with ``restart``, the run's
    old files (those its manifest lists, or a proven earlier run's) are removed. ``state``: the one ``check_out``
    read already."""
    path = folder / STATE
    if not restart and (path.exists() or path.is_symlink()):
        state = state if state is not None else load_state(folder, cap)
        if state["settings"] != settings:
            raise TrainError(f"{folder}: holds a partial run with other settings ({state['settings']!r:.2000}); "
                             "pass the same ones to resume, or --restart")
        why = step_problem(state, settings["steps"], MAX_STEPS)
        if why:
            raise TrainError(f"--out {folder}: cannot resume: {why}; {RESTART}")
        status.state_step = state["step"]
    else:
        state = None
    if restart:
        take(folder, owner)
        remove(folder, OURS)
    folder.mkdir(parents=True, exist_ok=True)
    return state


def _claim(folder: Path, *names: str) -> None:
    """List ``names`` in ``folder``'s manifest before they are written (a manifest kvlab did not write: one line)."""
    try:
        claim(folder, *names)
    except NotOurs as e:
        raise TrainError(str(e)) from None


# ---- one run --------------------------------------------------------------------------------------------------------

class _Run:
    """One training run's moving parts: the compact model, its optimiser, the data generator, the step, the wall
    clock trained and the log. ``save`` writes them whole to train_state.pt; ``resume`` reads them back."""

    def __init__(self, folder: Path, cfg, data: TrainingData, settings: dict, status: _Progress):
        self.folder, self.cfg, self.data, self.settings, self.status = folder, cfg, data, settings, status
        self.steps, self.minutes = settings["steps"], settings["minutes"]
        self.budget = self.steps if self.steps is not None else self.minutes * 60.0
        torch.manual_seed(settings["seed"])
        self.model = compact_model(cfg, len(data.vocab) + 1, settings["init_std"], n_full=cfg.vocab_size)
        self.bos = data.eot if settings.get("bos") else None  # the fixed first token (compact id), or None
        with torch.no_grad():
            if settings.get("mlp_off"):  # the MLPs join adding nothing, so joining does not change the model
                for b in self.model.blocks:
                    out = mlp_output(b)
                    out.weight.zero_()
                    if out.bias is not None:
                        out.bias.zero_()
        self.opt = make_optimizer(self.model, settings["peak_lr"], settings.get("weight_decay", WEIGHT_DECAY))
        self.gen = torch.Generator().manual_seed(settings["seed"])
        self.step, self.elapsed, self.log_rows, self.loss_ema = 0, 0.0, [], None

    def resume(self, state: dict) -> None:
        """Read back a state ``load_state`` checked; one that does not fit this run's model is one line."""
        why = fit_problem(self.model, self.opt, state)
        if why is None:
            try:
                self.model.load_state_dict(state["model"])
                self.opt.load_state_dict(state["optimizer"])
                self.gen.set_state(state["generator"])
                torch.set_rng_state(state["torch_rng"])
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
                first = (str(e).splitlines() or [""])[0]
                why = f"{STATE} does not load into the run ({type(e).__name__}: {first:.200})"
        if why:
            raise TrainError(f"--out {self.folder}: cannot resume: {why}; {RESTART}")
        self.step, self.elapsed, self.log_rows = int(state["step"]), float(state["elapsed"]), list(state["log"])

    def frac(self) -> float:
        return self.step / self.steps if self.steps is not None else self.elapsed / self.budget

    def lr(self) -> float:
        return lr_at(self.frac(), self.settings["peak_lr"])

    def save(self, rng: torch.Tensor | None = None) -> None:
        with blocked():
            buf = io.BytesIO()
            torch.save(dict(settings=self.settings, model=self.model.state_dict(), optimizer=self.opt.state_dict(),
                            generator=self.gen.get_state(), torch_rng=torch.get_rng_state() if rng is None else rng,
                            step=self.step, elapsed=self.elapsed, log=self.log_rows), buf)
            _claim(self.folder, STATE)
            atomic_write(self.folder / STATE, buf.getvalue())
            self.status.state_step = self.step

    def attention_only(self) -> bool:
        """True while the budget's first ``mlp_off`` share lasts: the MLPs are left out of the forward."""
        return attention_only_at(self.settings, self.step, self.elapsed)

    def shape(self) -> tuple[int, int]:
        """(rows, tokens per row) of the next batch: with the curriculum, rows of its lengths (those shorter than
        seq_len) for their shares of the budget, as many tokens per batch as later; then rows of seq_len tokens."""
        s = self.settings
        end = 0.0
        for length, share in s["curriculum"] or ():
            end += share
            if length < s["seq_len"] and self.frac() < end:
                return s["batch"] * s["seq_len"] // length, length
        return s["batch"], s["seq_len"]

    def train_step(self) -> tuple[float, float]:
        """One optimiser step on one batch of the mix: (loss, lr)."""
        s, d = self.settings, self.data
        lr = self.lr()
        for g in self.opt.param_groups:
            g["lr"] = lr
        rows, seq_len = self.shape()
        bos = self.bos is not None
        if self.frac() < s.get("copy_phase", 0.0):  # --copy-phase: every row a span shown twice among random ids
            x, y = twice_rows(rows, seq_len - bos, len(d.vocab), d.eot, self.gen)
            starts = None  # --copy-offsets: rows read their positions from a random start
            if self.frac() >= s.get("copy_offsets", 1.0) and seq_len < self.cfg.n_positions:
                starts = offset_starts(rows, self.cfg.n_positions, seq_len, s.get("offset_draw", OFFSET_DRAW),
                                       self.gen)
            if bos:
                x, y = with_bos(x, y, self.bos)
            with mlps_left_out(self.model, self.attention_only()):
                h = hidden(self.model, x, row_positions(rows, seq_len, starts, bos))  # (rows, seq_len, C)
            trained = y != IGNORE  # ~a fifth of the positions: only they go through the vocabulary projection
            logits = self.model.head(h[trained])  # (n, vocab)
            loss = F.cross_entropy(logits, y[trained])
        else:
            x, y = make_batch(d.ctrain, rows, seq_len - bos, s["copy_share"], len(d.vocab), d.eot, self.gen,
                              s.get("placed_share", 0.0), far_share=s.get("far_share", 0.0),
                              deep_draw=s.get("deep_draw", DEEP_DRAW), text_spans=s.get("text_spans", 0.0),
                              needle_share=s.get("needle_share", NEEDLE_SHARE),
                              tail=s.get("question_tail", QUESTION_TAIL))
            if bos:
                x, y = with_bos(x, y, self.bos)
            with mlps_left_out(self.model, self.attention_only()):
                logits = self.model.head(hidden(self.model, x))  # the model's forward, at positions 0..T-1
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        pin_embedding(self.model)
        self.step += 1
        self.loss_ema = loss.item() if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss.item()
        return loss.item(), lr

    def quick_eval(self, loss: float | str = "", lr: float = 0.0) -> dict:
        """A log row: the compact model's held-out NLL (training vocabulary) and its copy accuracy (QUICK_COPY) from
        position 0 and behind QUICK_FAR random tokens, of the model as it trains now (attention only in that phase)."""
        d, model = self.data, self.model
        model.eval()
        with torch.no_grad(), mlps_left_out(model, self.attention_only()):
            total = 0.0
            for i in range(0, len(d.quick_eval), 8):
                logits = model(d.quick_eval[i:i + 8, :-1])
                total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                               d.quick_tgt[i:i + 8, 1:].reshape(-1), ignore_index=IGNORE,
                                               reduction="sum"))
            k, n = QUICK_COPY
            n, ids = min(n, (self.settings["seq_len"] - (self.bos is not None)) // 2), d.copy_ids(full=False)
            copy = model_copy_accuracy(model, ids, n, k=k, bos=self.bos).second
            after = min(QUICK_FAR, self.cfg.n_positions - 2 * n - (self.bos is not None))
            far = round(model_copy_accuracy(model, ids, n, k=k, after=after, bos=self.bos).second, 4) if after > 0 \
                else ""
            sink = max(max(layer) for layer in attention_on_first(  # queries past half a short row
                model, d.quick_eval[:2, :-1], from_pos=min(SINK_FROM, self.settings["seq_len"] // 2)))
        model.train()
        row = dict(step=self.step, elapsed_s=round(self.elapsed, 2), train_loss=loss if loss == "" else round(loss, 4),
                   lr=lr, heldout_nll=round(total / int((d.quick_tgt[:, 1:] != IGNORE).sum()), 4),
                   copy_acc=round(copy, 4), copy_far_acc=far, sink_max=round(sink, 4))
        self.log_rows.append(row)
        return row


def _progress_bar(run: _Run, status: _Progress):
    from tqdm import tqdm

    steps = run.steps
    bar = status.bar = tqdm(total=steps if steps is not None else round(run.budget),
                            initial=run.step if steps else round(run.elapsed), unit="step" if steps else "s",
                            dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
    return bar


def _loop(run: _Run, status: _Progress, stop_after: int | None, eval_every: int, progress: bool) -> bool:
    """Train until the budget is spent (True) or ``stop_after`` steps ran (False); a stop signal during a step saves
    the state at the end of that step and stops. Logs a quick evaluation every ``eval_every`` steps (or, with a
    minutes budget, twelve times), saves the state every minute of training."""
    eval_secs = run.budget / 12 if run.steps is None else None
    last_eval_t = last_save_t = run.elapsed
    bar = _progress_bar(run, status) if progress else None
    run.model.train()
    ran = 0
    while run.frac() < 1.0 and (stop_after is None or ran < stop_after):
        t0 = time.perf_counter()
        loss, lr = run.train_step()
        ran += 1
        run.elapsed += time.perf_counter() - t0
        row = None
        if (eval_every and run.step % eval_every == 0) or (eval_secs and run.elapsed - last_eval_t >= eval_secs):
            last_eval_t = run.elapsed
            row = run.quick_eval(loss, lr)
        if bar is not None:
            bar.update(1 if run.steps else round(run.elapsed) - bar.n)
            bar.set_postfix(loss=f"{run.loss_ema:.3f}", lr=f"{lr:.2e}")
            if row:
                bar.write(f"step {run.step} ({run.elapsed:.0f} s): train loss {run.loss_ema:.3f}, held-out NLL "
                          f"{row['heldout_nll']:.3f} (training vocabulary), copy accuracy {row['copy_acc']:.3f}, behind "
                          f"{QUICK_FAR}: {row['copy_far_acc']}, most attention a head puts on position 0: "
                          f"{row['sink_max']}" +
                          (" (attention only)" if run.attention_only() else ""))
        status.step = run.step
        if Stop.signum is not None:  # a stop signal arrived during this step: save it whole, then stop
            run.save()
            status.saved_now = True
            raise Interrupted(Stop.signum)
        if run.elapsed - last_save_t >= 60:
            last_save_t = run.elapsed
            run.save()
    if bar is not None:
        bar.close()
    return run.frac() >= 1.0


# ---- train ----------------------------------------------------------------------------------------------------------

def _check_choices(family, offset_draw, deep_draw, text_spans, question_tail, needle_share) -> None:
    """The named and the share settings ``train`` takes beyond check_settings': one TrainError for a bad one."""
    if family not in FAMILY_PRESETS:
        raise TrainError(f"--family {family!r}: use one of {', '.join(FAMILY_PRESETS)}")
    if offset_draw not in OFFSET_DRAWS:
        raise TrainError(f"--offset-draw {offset_draw!r}: use one of {', '.join(OFFSET_DRAWS)}")
    if deep_draw not in DEEP_DRAWS:
        raise TrainError(f"--deep-draw {deep_draw!r}: use one of {', '.join(sorted(DEEP_DRAWS))}")
    if not (isinstance(text_spans, (int, float)) and 0 <= text_spans <= 1):
        raise TrainError(f"--text-spans must lie in [0, 1] (a chance per span), got {text_spans!r}")
    if not (isinstance(question_tail, (int, float)) and 0 <= question_tail <= 0.5):
        raise TrainError(f"--question-tail must lie in [0, 0.5] (a share of the row), got {question_tail!r}")
    if not (isinstance(needle_share, (int, float)) and 0 <= needle_share <= 1):
        raise TrainError(f"--needle-share must lie in [0, 1] (a chance per recall row), got {needle_share!r}")


def train(out: str | os.PathLike, minutes: float | None = None, steps: int | None = None, seed: int = 0,
          restart: bool = False, config=None, stop_after: int | None = None,
          save_dtype: str = "fp16", batch: int = BATCH, seq_len: int = SEQ_LEN, eval_every: int | None = None,
          eval_tokens: int | None = None, progress: bool = True, command: str | None = None,
          copy_share: float = COPY_SHARE, init_std: float = INIT_STD, peak_lr: float = PEAK_LR,
          curriculum=True, threads: int | None = None, placed_share: float = PLACED_SHARE,
          mlp_off: float = MLP_OFF, copy_phase: float = COPY_PHASE, copy_offsets: float | None | str = "default",
          family: str = "gpt2", bos: bool = BOS, weight_decay: float = WEIGHT_DECAY,
          far_share: float = FAR_SHARE, deep_draw: str = DEEP_DRAW, text_spans: float = TEXT_SPANS,
          needle_share: float = NEEDLE_SHARE, offset_draw: str = OFFSET_DRAW,
          question_tail: float = QUESTION_TAIL) -> dict:
    """Train (or resume, or report) the run in ``out``; returns its ``kvlab_train`` record (``done`` False when
    ``stop_after`` interrupted it). The budget is ``minutes`` of wall clock or ``steps`` (deterministic), not both;
    neither: DEFAULT_STEPS. ``config``, ``batch``, ``seq_len``, ``eval_every``, ``eval_tokens`` (the final held-out
    evaluation's size; default: the whole split), ``copy_share``, ``init_std``, ``peak_lr`` and ``curriculum`` exist
    for quick tests; the mini checkpoint uses the defaults.

    A stop signal (inside ``harness.common.signals.stop_signals``; Ctrl-C anywhere) raises ``Interrupted``, whose
    message says what was saved (see the module docstring)."""
    status = _Progress(Path(out), restart)
    Stop.stopping = False
    if copy_offsets == "default":  # COPY_OFFSETS inside a copy phase that outlasts it, else none
        copy_offsets = COPY_OFFSETS if copy_phase > COPY_OFFSETS else None
    recipe = dict(batch=batch, seq_len=seq_len, copy_share=copy_share, init_std=init_std, peak_lr=peak_lr,
                  **({"placed_share": placed_share} if placed_share else {}),  # absent when off: a record names only the phases it had
                  **({"far_share": far_share} if far_share else {}),
                  **({"deep_draw": deep_draw} if far_share and deep_draw != DEEP_DRAW else {}),
                  **({"text_spans": text_spans} if text_spans else {}),
                  **({"needle_share": needle_share} if far_share and needle_share != NEEDLE_SHARE else {}),
                  **({"question_tail": question_tail} if far_share and question_tail else {}),
                  **({"mlp_off": mlp_off} if mlp_off else {}),
                  **({"copy_phase": copy_phase} if copy_phase else {}),
                  **({"copy_offsets": copy_offsets} if copy_offsets is not None else {}),
                  **({"offset_draw": offset_draw} if copy_offsets is not None and offset_draw != OFFSET_DRAW else {}),
                  **({"bos": True} if bos else {}),
                  **({"weight_decay": weight_decay} if weight_decay != WEIGHT_DECAY else {}),
                  curriculum=curriculum_setting(curriculum))  # in the resume check
    _check_choices(family, offset_draw, deep_draw, text_spans, question_tail, needle_share)
    config = config or preset_config(FAMILY_PRESETS[family])
    try:
        return _train(Path(out), minutes, steps, seed, restart, config, stop_after, save_dtype, recipe, eval_every,
                      eval_tokens, progress, command, status, threads)
    except KeyboardInterrupt as e:  # Interrupted (a stop signal), or Ctrl-C without stop_signals
        signum = Stop.signum if Stop.signum is not None else getattr(e, "signum", signal.SIGINT)  # the first
        Stop.stopping, Stop.defer = True, False
        if status.bar is not None:
            status.bar.close()
        if status.save is not None and not status.complete:
            status.save()  # training was over: its state at the last step is consistent
        raise Interrupted(signum, status.message(signum)) from None
    finally:  # a signal after train() is over (its work is saved or complete) changes nothing
        Stop.defer, Stop.stopping = False, True


def _train(folder: Path, minutes, steps, seed, restart, config, stop_after, save_dtype, recipe: dict, eval_every,
           eval_tokens, progress, command, status: _Progress, threads: int | None = None) -> dict:
    """The recipe: check the settings and --out, report a finished run, resume or start one, train, finish."""
    cfg = config
    if steps is None and minutes is None:
        steps = DEFAULT_STEPS
    check_settings(minutes, steps, stop_after, save_dtype, recipe["batch"], recipe["seq_len"], recipe["copy_share"],
                   recipe["init_std"], recipe["peak_lr"], cfg, recipe.get("placed_share", 0.0),
                   recipe.get("mlp_off", 0.0), recipe["curriculum"], recipe.get("copy_phase", 0.0),
                   recipe.get("copy_offsets"), recipe.get("far_share", 0.0))
    cap = state_cap(cfg)
    owner, state = check_out(folder, cap)
    settings = dict(minutes=minutes, steps=steps, seed=seed, save_dtype=save_dtype, **recipe, family=cfg.family,
                    config=asdict(cfg))
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    if not restart and (meta := finished(folder)) is not None:
        num = lambda k: isinstance(meta.get(k), (int, float)) and not isinstance(meta.get(k), bool)  # noqa: E731
        facts = ([f"{meta['steps']:,} steps"] if num("steps") else []) + [
            f"{what} {meta[k]:.3f}" for k, what in (("heldout_nll", "held-out NLL"), ("prompts_nll", "prompts NLL"))
            if num(k)]
        say(f"{folder}: already trained ({', '.join(facts) or 'its record names no steps'}); --restart trains it again")
        return meta
    _check_writable(folder)
    state = _read_state(folder, settings, restart, status, owner, state, cap)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    data = TrainingData(recipe["seq_len"], eval_tokens, bos=recipe.get("bos", False))
    run = _Run(folder, cfg, data, settings, status)
    if state is not None:
        run.resume(state)
        say(f"{folder}: resuming at step {run.step} ({run.elapsed:.0f} s trained)")
    take(folder, owner)  # a folder trained before manifests gets one before training writes there
    status.step = run.step
    status.budget = f"of {steps} steps" if steps is not None else f"of the {minutes:g}-minute budget"
    Stop.defer = True  # from here a stop signal waits for the end of the step in progress, then the state is saved
    if run.step == 0:
        row = run.quick_eval()
        say(f"step 0: held-out NLL {row['heldout_nll']:.3f} (training vocabulary of {len(data.vocab):,} ids)")
    if eval_every is None:
        eval_every = max(1, steps // 20) if steps is not None else 0
    if not _loop(run, status, stop_after, eval_every, progress):
        run.save()
        say(f"{folder}: stopped at step {run.step} of the budget; run the same command again to resume")
        return dict(done=False, steps=run.step, elapsed_s=run.elapsed)
    return _finish(run, status, save_dtype, command, say)


def _finish(run: _Run, status: _Progress, save_dtype: str, command: str | None, say) -> dict:
    """Training is over: export the full-vocabulary model, evaluate it, write the checkpoint, remove the state.
    The compact model, optimiser and RNG are those of the last step, so a stop from here on saves them (the same
    command then only evaluates and exports); the export itself is not waited for."""
    rng_at_end = torch.get_rng_state()

    def save_at_end() -> None:
        run.save(rng_at_end)
        status.saved_now = True

    status.save = save_at_end
    Stop.defer = False
    if Stop.signum is not None:
        raise Interrupted(Stop.signum)
    say(f"trained {run.step} steps in {run.elapsed:.0f} s; writing the full-vocabulary checkpoint ...")
    t0 = time.perf_counter()
    d, s, seq_len = run.data, run.settings, run.settings["seq_len"]
    dtype = torch.float16 if save_dtype == "fp16" else torch.float32
    probe = d.remap[d.train_stream[: 8 * seq_len]].view(8, seq_len)
    if run.bos is not None:  # the hidden states the model sees in use: behind its first token
        probe = with_bos(probe[:, :-1], probe[:, :-1], run.bos)[0]
    full, unused_info = export_full(run.model, run.cfg, d.vocab, d.unseen_mass, seq_len, dtype, probe)
    meta = _record(run, full, unused_info, command)
    targets = meta.get("targets")
    run.log_rows.append(dict(step=run.step, elapsed_s=round(run.elapsed, 2), train_loss=round(run.loss_ema or 0.0, 4),
                             lr=lr_at(1.0, s["peak_lr"]), heldout_nll=meta["heldout_nll"],
                             copy_acc=targets["copy50_acc"] if targets else ""))
    _claim(run.folder, *(OURS - {STATE}))  # listed before they are written
    with blocked():  # the checkpoint and the state's removal, both or neither
        write_checkpoint(run.folder, full, dtype, meta, run.log_rows, bos=bool(s.get("bos")))
        (run.folder / STATE).unlink(missing_ok=True)
        status.complete = True
    say(f"{run.folder}: held-out NLL {meta['heldout_nll']:.3f} nats/token (full 50,257-way softmax, "
        f"{meta['heldout_tokens']:,} tokens), prompts.txt NLL {meta['prompts_nll']:.3f}; export and evaluation took "
        f"{time.perf_counter() - t0:.0f} s")
    if targets:
        say(targets_table(targets))
    full.eval()
    meta["_model"] = full  # for callers in this process (tests); not written anywhere
    return meta


def _retrieval_mix(s: dict) -> str:
    """The record's words for the retrieval rows of settings ``s`` (--far-share, --needle-share, --deep-draw)."""
    return (f"; {s['far_share']:.1%} of each batch's rows are retrieval rows, a third each: in KJV text windows a "
            f"random span ({SPAN_MIN}..{FAR_SPAN_MAX} ids, log-uniform) shown twice at any distance (uniform), "
            "or key-value pairs (8 + 8 random ids, up to 16, one in "
            + (f"{s['needle_share']:.0%} of" if "needle_share" in s else "a quarter of")
            + " the rows) with some of the keys asked at the end"
            + (f" and then up to {s['question_tail']:.0%} of the row of text" if s.get("question_tail") else "") + ";"
            f" and rows of random ids with a span ({SPAN_MIN}..{FAR_SPAN_MAX}, uniform) shown "
            "twice in a row at a random place (a copy deep in unpredictable context; in half of them the ids drawn "
            + ("as the training text uses them (by frequency)" if s.get("deep_draw") == "frequency" else
               "uniformly from the vocabulary of a random stretch of 46,000 tokens of training text")
            + "); only the second showing and the asked values targets")


def _copy_phase_mix(s: dict) -> str:
    """The record's words for the copy phase of settings ``s`` (--copy-phase, --copy-offsets, --offset-draw)."""
    offsets = s.get("copy_offsets")
    clamped = s.get("offset_draw") == "clamped"
    return (f"the first {s['copy_phase']:.0%} of the budget: every row random ids with one span of them shown twice "
            "in a row at a random place, only the second showing a target" + (
                "" if offsets is None else f" (from {offsets:.0%} of the budget on, each row's positions from a "
                "random start" + (", drawn over every position and a start past the last whole row's moved back to "
                                  "it, so the last positions are in as many rows as the middle ones" if clamped
                                  else "") + ", so every position trains)"))


def _record(run: _Run, full: Decoder, unused_info: dict, command: str | None) -> dict:
    """The ``kvlab_train`` record: corpus, mix, budget, NLLs and (for a model of EVAL_LEN positions trained on
    whole sequences) every target, measured on the saved values."""
    d, s = run.data, run.settings
    held_nll = nll(full, d.held_wins, skip=d.lead)
    bos = EOT if s.get("bos") else None
    full_len = s["seq_len"] >= EVAL_LEN and run.cfg.n_positions >= EVAL_LEN
    mix = (f"{s['copy_share']:.0%} of each batch's rows: a random span of the training split's ids (uniform, without "
           f"<|endoftext|>; log-uniform length {SPAN_MIN}..{s['seq_len'] // 2}) repeated to fill the row, the first "
           f"showing not a target; the rest: KJV text windows")
    if s.get("placed_share"):
        mix += (f"; {s['placed_share']:.0%} of the copy rows instead show their span twice in a row at a random place "
                "of a KJV text window (the first showing not a target)")
    if s.get("far_share"):
        mix += _retrieval_mix(s)
    if s.get("text_spans"):
        mix += (f"; every random span of the copy and retrieval rows draws its ids, with chance {s['text_spans']:g}, "
                "uniformly from the vocabulary of a random stretch of 46,000 tokens of training text rather than from "
                "every id")
    if s.get("copy_phase"):
        mix = _copy_phase_mix(s) + "; then " + mix
    if s.get("mlp_off"):
        mix += (f"; the first {s['mlp_off']:.0%} of the budget trains attention only (every MLP left out of the "
                "forward), then the MLPs join")
    return dict(done=True, corpus=CORPUS, mix=mix, heldout=f"chapters i % {HELDOUT_EVERY} == {HELDOUT_AT} "
                f"({len(d.held_stream):,} tokens)", train_tokens_in_split=len(d.train_stream),
                training_vocab=len(d.vocab), steps=run.step, tokens=run.step * s["batch"] * s["seq_len"],
                minutes=round(run.elapsed / 60, 3),
                budget=(f"{s['minutes']} minutes" if s["steps"] is None else f"{s['steps']} steps"),
                batch=s["batch"], seq_len=s["seq_len"], copy_share=s["copy_share"], span_min=SPAN_MIN,
                **({"placed_share": s["placed_share"]} if s.get("placed_share") else {}),
                **({"far_share": s["far_share"]} if s.get("far_share") else {}),
                **({"deep_draw": s["deep_draw"]} if s.get("deep_draw") else {}),
                **({"text_spans": s["text_spans"]} if s.get("text_spans") else {}),
                **({"needle_share": s["needle_share"]} if "needle_share" in s else {}),
                **({"mlp_off": s["mlp_off"]} if s.get("mlp_off") else {}),
                **({"copy_phase": s["copy_phase"]} if s.get("copy_phase") else {}),
                **({"copy_offsets": s["copy_offsets"]} if s.get("copy_offsets") is not None else {}),
                **({"offset_draw": s["offset_draw"]} if s.get("offset_draw") else {}),
                **({"question_tail": s["question_tail"]} if s.get("question_tail") else {}),
                curriculum=[[n, share] for n, share in s["curriculum"] or () if n < s["seq_len"]] or None,
                init_std=s["init_std"], peak_lr=s["peak_lr"], warmup_frac=WARMUP_FRAC, min_lr_frac=MIN_LR_FRAC,
                weight_decay=s.get("weight_decay", WEIGHT_DECAY), seed=s["seed"], save_dtype=s["save_dtype"],
                heldout_nll=round(held_nll, 4), heldout_tokens=int(d.held_wins[:, 1 + d.lead:].numel()),
                prompts_nll=round(prompts_nll(full, d.tok, bos), 4), **{k: round(v, 6) for k, v in unused_info.items()},
                **({"bos": True} if s.get("bos") else {}), family=s["family"],
                targets=evaluate(full, d.held_stream, d.copy_ids(full=True), seed=s["seed"], bos=bos)
                if full_len else None,
                targets_command="python -m harness.train --evaluate DIR",
                torch_version=torch.__version__, command=command or f"python -m harness.train --out {run.folder}")
