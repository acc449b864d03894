"""--out: which files there are kvlab's, and the training state, read bounded and checked before it is used.

kvlab writes, overwrites and deletes in a training folder only the names its manifest lists
(``harness.common.ownership``: ``.kvlab-manifest.json``, each name listed before it is written); a folder holding
anything else (dotfiles too) is refused in one line naming those files, before anything there is written or deleted.
A folder kvlab trained before manifests existed (the shipped models/weights/mini and mini-llama) has none: it is
kvlab's only with proof, when all it holds are the names a run writes (``OURS``, and the temporaries of kvlab's writes
of them) and its config.json carries kvlab's ``kvlab_train`` record (or, a run stopped before its checkpoint was
written, its train_state.pt is a training state kvlab wrote). Such a folder is adopted (its names listed in a new
manifest) only when training writes or deletes there (a resume, ``--restart``); reporting it finished, ``--evaluate``
and ``--record`` write no manifest (one committed with a shipped checkpoint would be another folder's in every clone).

The training state (train_state.pt) is loaded with ``weights_only=True`` after its size is bounded (``state_cap``: a
state holds the model, AdamW's two moments and the RNGs, about 3x the model in fp32; the cap is 4x the
full-vocabulary model's fp32 size plus 64 MiB), then checked whole (``state_problem``, ``fit_problem``): what is wrong
is one line (TrainError) naming it, never a traceback inside the loop.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from harness.common.ownership import (BOOKKEEPING, MANIFEST, adopt, entries, file_problem, foreign, manifest_problem,
                                      owned)
from harness.train.recipe import LOG_FIELDS, OURS, STATE, TrainError
from models.families import build
from models.hf_checkpoint import CheckpointError
from models.hf_checkpoint import read_config as hf_read_config

STATE_KEYS = ("settings", "model", "optimizer", "generator", "torch_rng", "step", "elapsed", "log")
RESTART = "pass --restart to start over"


def read_config(folder: Path) -> dict | None:
    """``folder``/config.json as a JSON object (None: absent, not a regular file, over its 16 MiB cap, not a JSON
    object): ``models.hf_checkpoint.read_config``'s bounded read, its refusals read as "not kvlab's"."""
    try:
        return hf_read_config(folder)
    except CheckpointError:
        return None


def is_kvlab_training(folder: Path) -> bool:
    """Whether ``folder``'s config.json is one kvlab's training wrote (it carries a ``kvlab_train`` record)."""
    return isinstance((read_config(folder) or {}).get("kvlab_train"), dict)


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n)[1:-1] for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _run_names(names: list[str]) -> bool:
    """Whether every name is one a run writes, or a temporary of kvlab's atomic write of one (``.NAME.*.tmp``)."""
    return all(n in OURS or (n.startswith(".") and n.endswith(".tmp") and any(n.startswith(f".{o}.") for o in OURS))
               for n in names)


def _has_manifest(folder: Path) -> bool:
    p = folder / MANIFEST
    return p.exists() or p.is_symlink()


def check_out(folder: Path, cap: int) -> tuple[str, dict | None]:
    """Refuse (TrainError, one line) an ``--out`` that is a file, holds files kvlab did not write, or holds a
    checkpoint kvlab did not train, before anything is written or deleted. Else how kvlab owns it: "new" (absent or
    empty), "manifest", or "legacy" (trained before manifests, proven); and the training state read as that proof
    (a legacy folder without config.json), else None."""
    if folder.is_symlink() and not folder.exists():
        raise TrainError(f"--out {folder}: is a link to {os.readlink(folder)}, which does not exist; give a folder")
    if folder.exists() and not folder.is_dir():
        raise TrainError(f"--out {folder}: is a file, not a folder")
    if not folder.exists():
        return "new", None  # made later, if it can be (``loop._check_writable``)
    try:
        present = [n for n in entries(folder) if n not in BOOKKEEPING]
    except OSError as e:
        raise TrainError(f"--out {folder}: cannot list it ({e.strerror or e}); give a folder you can read and "
                         "write") from None
    dirs = [n for n in present if n in OURS and (folder / n).is_dir() and not (folder / n).is_symlink()]
    if dirs:
        raise TrainError(f"--out {folder}: holds a folder named {_shown(dirs)}, where a run writes a file; kvlab never "
                         "deletes or writes into it: move it away or give a new or empty folder")
    if not _has_manifest(folder) and _run_names(present) and "config.json" in present:
        if not is_kvlab_training(folder):
            raise TrainError(f"--out {folder}: holds a checkpoint kvlab did not train (its config.json has no "
                             "kvlab_train record); kvlab never overwrites it: give a new or empty folder")
        return "legacy", None
    if not _has_manifest(folder) and present and _run_names(present):  # a run stopped before its checkpoint
        if STATE not in present:
            why = f"it holds {_shown(present)} but no {STATE} or config.json of a kvlab run"
        else:
            state, why = read_state(folder, cap)
            if why is None:
                return "legacy", state
        raise TrainError(f"--out {folder}: kvlab cannot show these files are its own ({why}); kvlab never deletes or "
                         "overwrites what it did not write: move them away or give a new or empty folder")
    names = foreign(folder) if _has_manifest(folder) else [n for n in present if not _run_names([n])]
    if names:
        why = manifest_problem(folder)
        raise TrainError(f"--out {folder}: holds files kvlab did not write ({_shown(names)}{'; ' + why if why else ''})"
                         ", so it is not a kvlab training run's folder; kvlab never writes into or empties such a "
                         "folder: give a new or empty folder")
    others = sorted(n for n in present if n not in OURS and n in owned(folder))
    if others:  # kvlab's own, but of a run, a sweep or a report: not a training run's folder
        raise TrainError(f"--out {folder}: holds files kvlab wrote for something other than training "
                         f"({_shown(others)}: a run's, a sweep's or a report's), so it is not a training run's folder: "
                         "give a new or empty folder")
    if (folder / "config.json").exists() and not is_kvlab_training(folder):
        raise TrainError(f"--out {folder}: holds a checkpoint kvlab did not train (its config.json has no "
                         "kvlab_train record); kvlab never overwrites it: give a new or empty folder")
    return ("manifest" if _has_manifest(folder) else "new"), None


def take(folder: Path, owner: str) -> None:
    """Before training first writes or deletes in a folder kvlab trained before manifests: list its names in one."""
    if owner == "legacy":
        adopt(folder, OURS, lambda _: True)  # proven by check_out


def check_recordable_folder(folder: Path) -> None:
    """``--record``: refuse (TrainError) a folder whose config.json kvlab may not overwrite: listed in its manifest,
    or a folder trained before manifests, proven (all it holds a run's names, its config.json a kvlab record)."""
    folder = Path(folder)
    if _has_manifest(folder):
        why = manifest_problem(folder) or (None if "config.json" in owned(folder) else
                                           f"its {MANIFEST} does not list config.json")
    else:
        try:
            others = [n for n in entries(folder) if n not in BOOKKEEPING and not _run_names([n])]
        except OSError as e:
            raise TrainError(f"--record {folder}: cannot list it ({e.strerror or e}); give a folder you can read")\
                from None
        why = f"it also holds {_shown(others)}, which no training run writes" if others else None
    if why:
        raise TrainError(f"--record {folder}: kvlab cannot show its config.json is its own ({why}); kvlab writes only "
                         "into checkpoints it trained: measure it with --evaluate alone")


# ---- the training state -------------------------------------------------------------------------------------------

def state_cap(cfg) -> int:
    """The most bytes of train_state.pt kvlab reads for a model of ``cfg``: 4x the full-vocabulary model's fp32
    parameters, plus 64 MiB (a state is the compact model, AdamW's two moments, the RNGs and a short log)."""
    with torch.device("meta"):  # counted, not allocated
        params = sum(p.numel() for p in build(cfg).parameters())
    return 4 * 4 * params + 64 * 2 ** 20


def read_state(folder: Path, cap: int) -> tuple[dict | None, str | None]:
    """``folder``/train_state.pt, at most ``cap`` bytes, loaded with weights_only=True and shaped as a training state
    (``state_problem``): (the state, None), or (None, what is wrong)."""
    path = Path(folder) / STATE
    why = file_problem(path, cap)
    if why:
        return None, why
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (any unpickling or zip error: the file is not a state)
        return None, f"{STATE} is not a file torch.load(weights_only=True) reads ({type(e).__name__})"
    why = state_problem(state)
    return (None, why) if why else (state, None)


def load_state(folder: Path, cap: int) -> dict:
    """``read_state``'s state, or TrainError: one line naming what is wrong, and that --restart starts over."""
    state, why = read_state(folder, cap)
    if why:
        raise TrainError(f"--out {folder}: cannot resume: {why}; {RESTART}")
    return state


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _plain(v, depth: int = 0) -> bool:
    """Whether ``v`` is what settings hold: None, numbers, strings, and lists and str-keyed dicts of them."""
    if depth > 8:
        return False
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_plain(x, depth + 1) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _plain(x, depth + 1) for k, x in v.items())


def state_problem(state) -> str | None:
    """What makes ``state`` not a training state kvlab wrote (None: nothing): its type, a missing key, a value of the
    wrong type, an RNG state of the wrong size, a log row that is not one."""
    if not isinstance(state, dict):
        return f"{STATE} holds a {type(state).__name__}, not a training state (a dict)"
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        return f"{STATE} lacks {', '.join(missing)}"
    if not isinstance(state["settings"], dict) or not _plain(state["settings"]):
        return f"{STATE}'s settings are not a dict of plain values"
    model = state["model"]
    if not (isinstance(model, dict) and model and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in model.items())):
        return f"{STATE}'s model is not a dict of named tensors"
    opt = state["optimizer"]
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in opt["param_groups"])):
        return f"{STATE}'s optimizer is not an optimizer's state (state, param_groups)"
    for key, want in (("generator", torch.Generator().get_state()), ("torch_rng", torch.get_rng_state())):
        t = state[key]
        if not (isinstance(t, torch.Tensor) and t.dtype == want.dtype and t.shape == want.shape):
            return f"{STATE}'s {key} is not a random generator's state ({want.numel():,} bytes)"
    if not isinstance(state["step"], int) or isinstance(state["step"], bool):
        return f"{STATE}'s step is a {type(state['step']).__name__}, not an integer"
    if not _number(state["elapsed"]) or state["elapsed"] < 0:
        return f"{STATE}'s elapsed time {state['elapsed']!r:.40} is not a number of seconds >= 0"
    log = state["log"]
    if not isinstance(log, list) or not all(isinstance(r, dict) and set(r) <= set(LOG_FIELDS) and all(
            isinstance(v, (int, float, str)) for v in r.values()) for r in log):
        return f"{STATE}'s log is not a list of rows of {', '.join(LOG_FIELDS)}"
    return None


def step_problem(state: dict, steps: int | None, most: int) -> str | None:
    """Why ``state``'s step cannot be this run's (None: it can): below 0, or above its ``steps`` (a minutes budget:
    above ``most``)."""
    limit = steps if steps is not None else most
    if not 0 <= state["step"] <= limit:
        return (f"{STATE}'s step {state['step']:,} lies outside 0 .. {limit:,} (the run's "
                f"{'steps' if steps is not None else 'most steps'})")
    return None


def fit_problem(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> str | None:
    """What in ``state`` does not fit this run's ``model`` and ``opt`` (None: it fits): a missing or unexpected
    weight, one of another shape; an optimizer of other groups, other hyperparameters, or moments of other shapes."""
    want, got = model.state_dict(), state["model"]
    missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
    if missing:
        return f"{STATE}'s model lacks {_shown(missing)}"
    if extra:
        return f"{STATE}'s model has {_shown(extra)}, which the run's model has not"
    for k, t in want.items():
        if got[k].shape != t.shape:
            return f"{STATE}'s {k} is {tuple(got[k].shape)}, the run's model's {tuple(t.shape)}"
    fresh, saved = opt.state_dict(), state["optimizer"]
    groups = [len(g["params"]) for g in fresh["param_groups"]]
    if [len(g["params"]) for g in saved["param_groups"]] != groups:
        return f"{STATE}'s optimizer groups other parameters than the run's ({groups})"
    for g, f in zip(saved["param_groups"], fresh["param_groups"]):
        for k, v in f.items():
            if k not in ("params", "lr", "initial_lr") and (k in g or k in ("betas", "eps", "weight_decay")):
                if not _plain(g.get(k)) or g.get(k) != v:
                    return f"{STATE}'s optimizer has {k} {g.get(k)!r:.40}, the run's {v!r}"
        if not _number(g.get("lr", 0.0)):
            return f"{STATE}'s optimizer has lr {g.get('lr')!r:.40}, not a number"
    params = [p for g in opt.param_groups for p in g["params"]]  # a state_dict numbers them so
    for i, s in saved["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(params) or not isinstance(s, dict):
            return f"{STATE}'s optimizer holds a state for {i!r:.40}, not one of the run's {len(params)} parameters"
        for k in ("exp_avg", "exp_avg_sq"):
            t = s.get(k)
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == params[i].shape):
                return f"{STATE}'s optimizer's {k} of parameter {i} is not a float tensor of {tuple(params[i].shape)}"
        step = s.get("step")
        if not (isinstance(step, torch.Tensor) and step.numel() == 1 and step.is_floating_point() or _number(step)):
            return f"{STATE}'s optimizer's step of parameter {i} is not a number"
    return None
