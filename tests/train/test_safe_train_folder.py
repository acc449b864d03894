"""``python -m harness.train`` owns only what it wrote: an ``--out`` holding anything kvlab did not write (its manifest,
``.kvlab-manifest.json``, says what it wrote; dotfiles count) is refused before anything is read, written or deleted;
a folder trained before manifests (the shipped mini) is kvlab's only with proof; ``--restart`` removes only its own
files; and a train_state.pt that is not a state kvlab wrote, too big, or of a step outside the run is one line, exit
2. ``CASES`` lists each case with what kvlab now does (docs/faults.md's fault table lists the same ids)."""

import argparse
import os
import shutil

import pytest
import torch

from harness.common import ownership
from harness.train import __main__ as cli
from harness.train import corpus, loop, targets
from harness.train.recipe import OURS, STATE, TrainError
from models.gpt2 import GPT2Config
from tests.helpers import REPO, one_line, untested_cases

CASES = [
    ("train-out-foreign-files", "--out DIR holding files kvlab did not write (a user's heldout.txt and train_log.csv, "
                                "notes.txt, a dotfile, or such files beside a kvlab run), with or without --restart: "
                                "`error: --out DIR: holds files kvlab did not write (notes.txt), so it is not a kvlab "
                                "training run's folder; ...` (or `kvlab cannot show these files are its own (it holds "
                                "heldout.txt, train_log.csv but no train_state.pt or config.json of a kvlab run)`), "
                                "exit 2, before any data loads, every file byte for byte kept"),
    ("train-restart-owns-only-its-files", "--restart removes only the names .kvlab-manifest.json lists (and a proven "
                                          "pre-manifest run's), then trains; a foreign file beside them refuses it"),
    ("train-legacy-folder", "a folder trained before manifests (a copy of models/weights/mini or mini-llama: "
                            "config.json with kvlab_train, only a run's names) is reported `already trained` with "
                            "nothing written; --restart adopts it (a manifest of its names) and retrains; a stopped "
                            "run without a manifest resumes when its train_state.pt is a kvlab state; one with a file "
                            "of the user's, or a state kvlab did not write, is refused and kept"),
    ("train-record-owns-only-its-files", "--evaluate DIR --record where DIR holds files no run writes, or a manifest "
                                         "not listing config.json: `error: --record DIR: kvlab cannot show its "
                                         "config.json is its own (...)`, exit 2, before measuring"),
    ("train-state-malformed", "a train_state.pt that loads but is not a state (a list, a dict missing keys, values "
                              "of the wrong type, tensors of the wrong shape, an optimizer that does not fit), or "
                              "not a weights_only file: `error: --out DIR: cannot resume: train_state.pt lacks "
                              "optimizer, step; pass --restart to start over`, exit 2, never a traceback; --restart "
                              "then starts over"),
    ("train-state-step-bounds", "a state whose step is 10**12, -1 or past the run's --steps: `error: --out DIR: cannot "
                                "resume: train_state.pt's step 1,000,000,000,000 lies outside 0 .. 3 (the run's "
                                "steps); pass --restart to start over`, exit 2, before any data loads"),
    ("train-state-bounded", "a train_state.pt over the cap (4x the full-vocabulary model's fp32 size + 64 MiB), a "
                            "FIFO, a link to /dev/zero: one line (`train_state.pt holds N bytes, more than the M kvlab "
                            "reads for it` / `is not a regular file`), exit 2, nothing read"),
    ("train-out-hostile", "a .kvlab-manifest.json that is a folder, a run folder copied with its manifest, --out a "
                          "link to a user's folder or to nothing, a folder where the manifest lists train_state.pt: "
                          "one line each, exit 2, with or without --restart, nothing changed; a finished record "
                          "without its numbers is reported (`already trained (its record names no steps)`)"),
]

SMALL = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)
FAST = dict(config=SMALL, batch=8, seq_len=32, eval_tokens=1024, eval_every=1000, progress=False)
STEPS = ["--steps", "3"]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


@pytest.fixture(autouse=True)
def small(monkeypatch):
    """The command line with the small model (its checks are main's and train()'s, the same at any size); the
    prompts' NLL (seconds of the full softmax) is not what these tests check."""
    monkeypatch.setattr(corpus, "EVAL_TOKENS", 256)
    monkeypatch.setattr(loop, "prompts_nll", lambda *a, **k: 0.0)
    real = loop.train
    monkeypatch.setattr(cli, "train", lambda out, **kw: real(out, **kw, **FAST))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The state of a run the command line (``--steps 3``) stopped after its first step."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(corpus, "EVAL_TOKENS", 256)
        loop.train(out, steps=3, stop_after=1, **FAST)
    return torch.load(out / STATE, weights_only=True)


def no_data(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("data loaded before --out was checked")

    monkeypatch.setattr(corpus, "load_data", boom)


def files(folder) -> dict:
    return {p.name: (p.read_bytes() if p.is_file() else "dir") for p in folder.iterdir()}


def run(capsys, out, *extra) -> tuple[int, str]:
    rc = cli.main(["--out", str(out), *STEPS, *extra])
    return rc, capsys.readouterr().err


def state_run(folder, state) -> None:
    """A folder kvlab owns holding ``state`` as its train_state.pt."""
    ownership.claim(folder, STATE)
    torch.save(state, folder / STATE)


# ---- foreign files ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("restart", [False, True], ids=["plain", "restart"])
@pytest.mark.parametrize("theirs, kvlab_run, says", [
    ({"heldout.txt": b"my text", "train_log.csv": b"my log"}, False,
     "kvlab cannot show these files are its own (it holds heldout.txt, train_log.csv but no train_state.pt or "
     "config.json of a kvlab run)"),
    ({"notes.txt": b"mine"}, False, "holds files kvlab did not write (notes.txt), so it is not a kvlab training run"),
    ({".envrc": b"export X=1"}, False, "holds files kvlab did not write (.envrc)"),
    ({"heldout.txt": b"my text", "train_log.csv": b"my log"}, True,
     "holds files kvlab did not write (heldout.txt, train_log.csv)"),
    ({".secret": b"x"}, True, "holds files kvlab did not write (.secret)"),
], ids=["run-names", "notes", "dotfile", "beside-a-run", "dotfile-beside-a-run"])
def test_an_out_holding_files_kvlab_did_not_write_is_refused_and_kept(tmp_path, monkeypatch, capsys, stopped, theirs,
                                                                      kvlab_run, says, restart):
    # train-out-foreign-files
    out = tmp_path / "out"
    out.mkdir()
    if kvlab_run:
        state_run(out, stopped)
    for name, data in theirs.items():
        (out / name).write_bytes(data)
    before = files(out)
    no_data(monkeypatch)
    rc, err = run(capsys, out, *(["--restart"] if restart else []))
    line = one_line(err)
    assert rc == 2 and line.startswith(f"error: --out {out}: ") and says in line, line
    assert files(out) == before


# ---- --restart ----------------------------------------------------------------------------------------------------

def test_restart_removes_only_the_manifests_names(tmp_path, capsys, stopped):  # train-restart-owns-only-its-files
    out = tmp_path / "out"
    out.mkdir()
    state_run(out, {**stopped, "step": 2})
    (out / "notes.txt").write_text("mine")
    before = files(out)
    rc, err = run(capsys, out, "--restart")
    assert rc == 2 and "holds files kvlab did not write (notes.txt)" in one_line(err)
    assert files(out) == before  # refused: the state kvlab wrote is kept too
    (out / "notes.txt").unlink()
    assert run(capsys, out, "--restart")[0] == 0
    assert sorted(os.listdir(out)) == sorted({ownership.MANIFEST, *OURS} - {STATE})
    assert ownership.owned(out) == OURS and ownership.foreign(out) == []
    assert loop.finished(out)["steps"] == 3


# ---- folders trained before manifests -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mini", "mini-llama"])
def test_a_shipped_folder_is_reported_and_nothing_is_written(tmp_path, capsys, name):  # train-legacy-folder
    copy = tmp_path / name
    shutil.copytree(REPO / "models" / "weights" / name, copy)
    before = files(copy)
    meta = loop.train(copy, steps=3, **{**FAST, "progress": True})  # other settings: a finished folder is reported
    out = capsys.readouterr().out
    assert f"{copy}: already trained (3,200 steps, held-out NLL {meta['heldout_nll']:.3f}" in out
    assert files(copy) == before and not (copy / ownership.MANIFEST).exists()
    assert targets.check_recordable(copy)["kvlab_train"]["steps"] == 3200  # --record may rewrite its config.json


def test_a_shipped_folder_restarts_only_when_all_it_holds_is_a_runs(tmp_path, capsys):
    copy = tmp_path / "mini"  # train-legacy-folder
    shutil.copytree(REPO / "models" / "weights" / "mini", copy)
    (copy / "notes.txt").write_text("mine")
    before = files(copy)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "load", lambda *a, **k: pytest.fail("read a state"))
        rc, err = run(capsys, copy, "--restart")
    assert rc == 2 and "holds files kvlab did not write (notes.txt)" in one_line(err) and files(copy) == before
    (copy / "notes.txt").unlink()
    assert run(capsys, copy, "--restart")[0] == 0  # adopted (with proof), then retrained
    assert ownership.owned(copy) == OURS - {STATE} and ownership.foreign(copy) == []
    assert loop.finished(copy)["steps"] == 3
    assert (REPO / "models" / "weights" / "mini" / "config.json").read_bytes() != (copy / "config.json").read_bytes()


def test_a_run_stopped_before_manifests_resumes_only_with_a_kvlab_state(tmp_path, capsys, stopped):
    out = tmp_path / "out"  # train-legacy-folder
    out.mkdir()
    torch.save(stopped, out / STATE)  # as an earlier kvlab left it: no manifest
    rc, err = run(capsys, out)
    assert rc == 0, err
    assert ownership.owned(out) == OURS and loop.finished(out)["steps"] == 3
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"weights": torch.zeros(3)}, other / STATE)  # a file of that name kvlab did not write
    for extra in ([], ["--restart"]):
        before = files(other)
        rc, err = run(capsys, other, *extra)
        assert rc == 2 and one_line(err) == (
            f"error: --out {other}: kvlab cannot show these files are its own (train_state.pt lacks settings, model, "
            "optimizer, generator, torch_rng, step, elapsed, log); kvlab never deletes or overwrites what it did not "
            "write: move them away or give a new or empty folder")
        assert files(other) == before


def test_record_writes_only_into_a_folder_kvlab_owns(tmp_path, monkeypatch, capsys):  # train-record-owns-only-its-files
    monkeypatch.setattr(cli, "evaluate_folder", lambda f: pytest.fail("measured before the check"))
    copy = tmp_path / "mini"
    shutil.copytree(REPO / "models" / "weights" / "mini", copy)
    (copy / "notes.txt").write_text("mine")
    before = files(copy)
    assert cli.main(["--evaluate", str(copy), "--record"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"error: --record {copy}: kvlab cannot show its config.json is its own (it also holds notes.txt, which no "
        "training run writes); kvlab writes only into checkpoints it trained: measure it with --evaluate alone")
    (copy / "notes.txt").unlink()
    ownership.claim(copy, "heldout.txt")  # a manifest that does not list config.json
    with pytest.raises(TrainError, match="its .kvlab-manifest.json does not list config.json"):
        targets.check_recordable(copy)
    assert {k: v for k, v in files(copy).items() if k != ownership.MANIFEST} == {
        k: v for k, v in before.items() if k != "notes.txt"}


# ---- the training state -------------------------------------------------------------------------------------------

def _moment(s):
    opt = {**s["optimizer"], "state": dict(s["optimizer"]["state"])}
    opt["state"][0] = {**opt["state"][0], "exp_avg": torch.zeros(3)}
    return {**s, "optimizer": opt}


def _groups(s):
    groups = [dict(g) for g in s["optimizer"]["param_groups"]]
    groups[0]["betas"] = "fast"
    return {**s, "optimizer": {**s["optimizer"], "param_groups": groups}}


def _wte(s):
    model = dict(s["model"])
    model["transformer.wte.weight"] = torch.zeros(3, 32)
    return {**s, "model": model}


MALFORMED = [  # (id, the state from the stopped run's, what the line says, whether it is seen before data loads)
    ("a-list", lambda s: [1, 2, 3], "train_state.pt holds a list, not a training state (a dict)", True),
    ("missing-keys", lambda s: {k: v for k, v in s.items() if k not in ("optimizer", "step")},
     "train_state.pt lacks optimizer, step", True),
    ("step-a-string", lambda s: {**s, "step": "1"}, "train_state.pt's step is a str, not an integer", True),
    ("step-a-bool", lambda s: {**s, "step": True}, "train_state.pt's step is a bool, not an integer", True),
    ("settings-a-tensor", lambda s: {**s, "settings": torch.zeros(2)},
     "train_state.pt's settings are not a dict of plain values", True),
    ("model-a-list", lambda s: {**s, "model": [torch.zeros(2)]}, "train_state.pt's model is not a dict of named", True),
    ("rng-short", lambda s: {**s, "generator": torch.zeros(3, dtype=torch.uint8)},
     "train_state.pt's generator is not a random generator's state (5,056 bytes)", True),
    ("elapsed-nan", lambda s: {**s, "elapsed": float("nan")}, "train_state.pt's elapsed time nan is not", True),
    ("log-rows", lambda s: {**s, "log": [{"bogus": 1}]}, "train_state.pt's log is not a list of rows of step", True),
    ("not-weights-only", lambda s: {**s, "log": argparse.Namespace()},
     "train_state.pt is not a file torch.load(weights_only=True) reads (UnpicklingError)", True),
    ("weight-shape", _wte, "train_state.pt's transformer.wte.weight is (3, 32), the run's model's (", False),
    ("weight-missing", lambda s: {**s, "model": {k: v for k, v in s["model"].items() if "ln_f" not in k}},
     "train_state.pt's model lacks transformer.ln_f.weight, transformer.ln_f.bias", False),
    ("weight-extra", lambda s: {**s, "model": {**s["model"], "extra": torch.zeros(1)}},
     "train_state.pt's model has extra, which the run's model has not", False),
    ("moment-shape", _moment, "train_state.pt's optimizer's exp_avg of parameter 0 is not a float tensor of (", False),
    ("betas", _groups, "train_state.pt's optimizer has betas 'fast', the run's (0.9, 0.95)", False),
]


@pytest.mark.parametrize("make, says, early", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_state_is_one_line_and_kept(tmp_path, monkeypatch, capsys, stopped, make, says,
                                                                early):  # train-state-malformed
    out = tmp_path / "out"
    out.mkdir()
    state_run(out, make(stopped))
    before = files(out)
    if early:
        no_data(monkeypatch)
    rc, err = run(capsys, out)
    line = one_line(err)
    assert rc == 2 and line.startswith(f"error: --out {out}: cannot resume: {says}"), line
    assert line.endswith("; pass --restart to start over") and files(out) == before


@pytest.mark.slow  # seconds: not in make test-fast
def test_restart_starts_over_from_a_malformed_state(tmp_path, capsys):  # train-state-malformed
    out = tmp_path / "out"
    out.mkdir()
    state_run(out, [1, 2, 3])
    assert run(capsys, out, "--restart")[0] == 0
    assert loop.finished(out)["steps"] == 3 and not (out / STATE).exists()


@pytest.mark.parametrize("step, limit", [(10 ** 12, "1,000,000,000,000"), (-1, "-1"), (4, "4")])
def test_a_step_outside_the_run_is_refused(tmp_path, monkeypatch, capsys, stopped, step, limit):
    out = tmp_path / "out"  # train-state-step-bounds
    out.mkdir()
    state_run(out, {**stopped, "step": step})
    no_data(monkeypatch)
    rc, err = run(capsys, out)
    assert rc == 2 and one_line(err) == (f"error: --out {out}: cannot resume: train_state.pt's step {limit} lies "
                                         "outside 0 .. 3 (the run's steps); pass --restart to start over")


def test_a_state_that_is_too_big_or_not_a_file_is_never_read(tmp_path, monkeypatch, capsys):  # train-state-bounded
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("read a state"))
    cap = loop.state_cap(SMALL)
    assert 64 * 2 ** 20 < cap < 128 * 2 ** 20  # the small model: 1.6M parameters
    big, fifo, link = (tmp_path / n for n in ("big", "fifo", "link"))
    for folder in (big, fifo, link):
        folder.mkdir()
        ownership.claim(folder, STATE)
    with open(big / STATE, "wb") as f:
        f.truncate(cap + 1)  # sparse: no disk used
    os.mkfifo(fifo / STATE)
    os.symlink("/dev/zero", link / STATE)
    for folder, why in [(big, f"train_state.pt holds {cap + 1:,} bytes, more than the {cap:,} kvlab reads for it"),
                        (fifo, "train_state.pt is not a regular file"), (link, "train_state.pt is not a regular file")]:
        rc, err = run(capsys, folder)
        assert rc == 2 and one_line(err) == (f"error: --out {folder}: cannot resume: {why}; pass --restart to start "
                                             "over")


# ---- hostile folders ----------------------------------------------------------------------------------------------

def test_hostile_folders_are_one_line_and_kept(tmp_path, monkeypatch, capsys, stopped):  # train-out-hostile
    no_data(monkeypatch)
    bad = tmp_path / "bad"
    (bad / ownership.MANIFEST).mkdir(parents=True)  # a manifest that is a folder
    copied = tmp_path / "copied"
    copied.mkdir()
    state_run(copied, stopped)
    shutil.copytree(copied, tmp_path / "copy")  # a run folder copied with its manifest: that names the first
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(theirs)
    (tmp_path / "nothing").symlink_to(tmp_path / "missing")
    listed = tmp_path / "listed"  # a folder of the user's where the manifest lists a file kvlab wrote
    listed.mkdir()
    ownership.claim(listed, STATE)
    (listed / STATE).mkdir()
    (listed / STATE / "mine.txt").write_text("mine")
    for out, says in [
        (bad, "holds files kvlab did not write (.kvlab-manifest.json; its .kvlab-manifest.json is not a manifest "
              "kvlab wrote)"),
        (tmp_path / "copy", "holds files kvlab did not write (.kvlab-manifest.json, train_state.pt; its "
                            f".kvlab-manifest.json was written for another folder ({copied}))"),
        (tmp_path / "link", "holds files kvlab did not write (notes.txt)"),
        (tmp_path / "nothing", f"is a link to {tmp_path / 'missing'}, which does not exist; give a folder"),
        (listed, "holds a folder named train_state.pt, where a run writes a file; kvlab never deletes or writes into "
                 "it"),
    ]:
        before = files(out) if out.exists() else None
        for extra in ([], ["--restart"]):
            rc, err = run(capsys, out, *extra)
            line = one_line(err)
            assert rc == 2 and line.startswith(f"error: --out {out}: {says}"), line
            assert (files(out) if out.exists() else None) == before
    assert not (tmp_path / "missing").exists() and (listed / STATE / "mine.txt").read_text() == "mine"


def test_a_finished_record_without_its_numbers_is_still_reported(tmp_path, capsys):  # train-out-hostile
    out = tmp_path / "out"
    out.mkdir()
    ownership.claim(out, "config.json", "model.safetensors")
    (out / "config.json").write_text('{"model_type": "gpt2", "kvlab_train": {"done": true, "steps": "many"}}')
    (out / "model.safetensors").write_bytes(b"x")
    loop.train(out, steps=3, **{**FAST, "progress": True})
    said = capsys.readouterr().out
    assert said == f"{out}: already trained (its record names no steps); --restart trains it again\n"


def test_a_folder_kvlab_wrote_for_a_run_is_no_training_folder(tmp_path):  # train-out-hostile
    """A run's (or a sweep's, or a report's) folder has a kvlab manifest too, listing results.json and the like:
    training never writes its checkpoint into it."""
    from harness.common import ownership
    from harness.train import folder as train_folder

    run = tmp_path / "run"
    run.mkdir()
    ownership.claim(run, "results.json", "run.log")
    (run / "results.json").write_text("{}")
    with pytest.raises(TrainError, match=r"holds files kvlab wrote for something other than training \(results.json"):
        train_folder.check_out(run, 10 ** 9)
    assert sorted(p.name for p in run.iterdir()) == [".kvlab-manifest.json", "results.json"]
