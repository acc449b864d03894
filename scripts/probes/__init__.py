"""kvlab's research probes: the short experiments behind the findings in docs/ (README.md here maps each probe to
the doc section it feeds). Each is a module (``from scripts.probes import copy_probe``: tests import them so) and a
command, run either way from the repository's root:

    .venv/bin/python scripts/probes/<name>.py ...
    .venv/bin/python -m scripts.probes.<name> ...

They share training's pieces (``harness.train``) and the copy scores (``harness.core.copying``) rather than keeping
copies of their own. data/ holds the raw logs the docs cite.
"""
