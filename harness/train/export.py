"""The checkpoint: the compact model written back into the full GPT-2 vocabulary, and the files of a finished run.

After training the compact vocabulary's rows are written back into the full 50,257-row ``wte`` and every other row is
set to ``k / ln_f.weight``: its logit is then ``k * sum(ln_f.bias / ln_f.weight)`` for *every* input (LayerNorm's
normalised vector has zero mean), a constant chosen so the ~40k unused ids share the probability that Good-Turing
gives unseen tokens (the fraction of training tokens that occur once). Position rows past the training length copy
the last trained row (none, at 1,024).

The folder gets config.json (HF GPT-2 fields + ``kvlab_train``: corpus, mix, recipe, steps, tokens, minutes, NLLs,
the targets, seed, command), model.safetensors (HF names, Conv1D weights transposed; fp16 by default so the checkpoint
stays under 20 MB: our loader and the reported figures use those values in fp32), heldout.txt and train_log.csv (the
quick evaluation along the way: held-out NLL in the training vocabulary and copy accuracy at n = 50); config.json is
written last: a folder with config.json is complete.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import torch

from harness.common.ownership import atomic_write
from harness.train.corpus import corpus_documents, split_documents
from harness.train.folder import read_config
from harness.train.model import has_norm_bias, hidden
from harness.train.recipe import BOS_KEY, EOT, FREE_DIM, HELDOUT_TEXT, LOG_FIELDS
from models.decoder import Decoder
from models.families import build
from models.hf_checkpoint import to_safetensors


def export_full(compact: Decoder, cfg, vocab: torch.Tensor, unseen_mass: float, train_len: int,
                save_dtype: torch.dtype, probe: torch.Tensor) -> tuple[Decoder, dict]:
    """The full-vocabulary model of ``compact``'s family (see the module docstring), its values rounded to
    ``save_dtype`` so the model in memory is exactly the one that is saved."""
    full = build(cfg)
    emb = full.get_input_embeddings().weight
    emb_name = next(name for name, p in full.named_parameters() if p is emb)
    ours, theirs = full.state_dict(), compact.state_dict()
    with torch.no_grad():
        for name, t in ours.items():
            if name not in (emb_name, "lm_head.weight"):
                t.copy_(theirs[name])
        if has_norm_bias(full):
            info = _constant_logit(compact, full, cfg, vocab, unseen_mass, train_len, probe)
        else:  # the unused rows are zero (logit 0); the compact model's other-id slot was exactly their mass
            emb.zero_()
            emb[vocab] = compact.get_input_embeddings().weight[: len(vocab)]
            info = {"unused_rows_logit": 0.0}
        for p in full.parameters():
            p.copy_(p.to(save_dtype).to(p.dtype))
    return full, info


def _constant_logit(compact, full, cfg, vocab, unseen_mass: float, train_len: int, probe: torch.Tensor) -> dict:
    """GPT-2's export: every unused row k / gamma, one constant logit c through beta[FREE_DIM] (module docstring)."""
    ln_f = full.transformer.ln_f
    gamma = torch.where(ln_f.weight.abs() >= 1e-2, ln_f.weight, torch.where(ln_f.weight < 0, -1e-2, 1e-2))
    ln_f.weight.copy_(gamma)  # 1/gamma stays finite (|gamma| >= 0.01)
    n_unused = cfg.vocab_size - len(vocab)
    used = compact.transformer.wte.weight[: len(vocab)]
    # the constant logit c that gives the unused ids `unseen_mass` of the probability at a typical position
    compact.eval()
    h = compact.final_norm(hidden(compact, probe))
    lse = float(torch.logsumexp((h @ used.t()).float(), dim=-1).median())
    compact.train()
    c = lse + math.log(unseen_mass / (1 - unseen_mass)) - math.log(max(n_unused, 1))
    # unused rows k / gamma, as long as a typical used row; their logit is k * sum(beta / gamma), made c through
    # beta[FREE_DIM]: no used row reads that dimension (held at 0 in training), so their logits do not move
    k = -float(used.norm(dim=1).median()) / float((1 / gamma).norm())
    rest = float((ln_f.bias / gamma).sum() - ln_f.bias[FREE_DIM] / gamma[FREE_DIM])
    ln_f.bias[FREE_DIM] = (c / k - rest) * gamma[FREE_DIM]
    wte = full.transformer.wte.weight
    wte.copy_((k / gamma).expand_as(wte))
    wte[vocab] = used
    wpe = full.transformer.wpe.weight
    wpe[train_len:] = wpe[train_len - 1]
    return {"unused_rows_logit": c, "unused_rows_mass": unseen_mass, "unused_rows_k": k}


def write_heldout_text(folder: Path) -> Path:
    """``heldout.txt``: the held-out chapters, one per line, the prompts file of runs on this model (``model=mini``
    sets ``prompts_file`` to it): in-domain text the model never trained on."""
    docs = corpus_documents()
    _, held = split_documents(docs)
    path = Path(folder) / HELDOUT_TEXT
    atomic_write(path, ("\n".join(docs[i] for i in held) + "\n").encode())
    return path


def write_checkpoint(folder: Path, model: Decoder, dtype: torch.dtype, meta: dict | None = None,
                     log_rows: list[dict] | None = None, bos: bool = False) -> None:
    """model.safetensors, train_log.csv, heldout.txt, then config.json (last: a folder with config.json is
    complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_heldout_text(folder)
    state = to_safetensors(model.state_dict(), dtype, model.hf_format)  # HF names and layouts
    atomic_write(folder / "model.safetensors", state)
    if log_rows is not None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=LOG_FIELDS,
                           lineterminator="\n")
        w.writeheader()
        w.writerows(log_rows)
        atomic_write(folder / "train_log.csv", buf.getvalue().encode())
    cfg = model.hf_config_dict()
    cfg.update(bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True,
               torch_dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32"))
    if bos:  # trained with <|endoftext|> at position 0 of every row: runs put it in front of every sequence
        cfg[BOS_KEY] = True
    if meta is not None:
        cfg["kvlab_train"] = meta
    atomic_write(folder / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())


def finished(folder: Path) -> dict | None:
    """The ``kvlab_train`` record of a finished run in ``folder``, or None (config.json read bounded)."""
    meta = (read_config(Path(folder)) or {}).get("kvlab_train")
    done = isinstance(meta, dict) and meta.get("done") and (Path(folder) / "model.safetensors").is_file()
    return meta if done else None
