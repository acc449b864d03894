"""The tools' side of safe runs: ``python -m harness.kvcalc`` bounds every number and the JSON's depth before it
computes (one line, exit 2, never a traceback, never a list as long as an unchecked number), and ``python -m
harness.train`` stops on SIGINT, SIGTERM, SIGUSR2 and SIGHUP alike, saying exactly what it saved (exit 128 + the
signal's number; the same command resumes), and refuses an unwritable ``--out`` before any training starts.
``CASES`` lists each case with what kvlab now does (docs/faults.md's fault table lists the same ids)."""

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file

from harness.common import signals
from harness.common.ownership import MANIFEST
from harness.tools import kvcalc as K
from harness.train import __main__ as train_cli
from harness.train import corpus as train_corpus
from harness.train import loop as train_loop
from harness.train.recipe import MAX_THREADS, STATE
from models.gpt2 import GPT2Config
from tests.helpers import REPO, one_line, untested_cases

CASES = [
    ("kvcalc-huge-layers", "config.json with num_hidden_layers 10**30: `num_hidden_layers=1e+30 in PATH is beyond "
                           "what kvcalc computes: give 1 .. 10,000`, exit 2 (was an OverflowError)"),
    ("kvcalc-layers-2e9", "num_hidden_layers 2,000,000,000 (or 2e9) refused in one line, exit 2, before any per-layer "
                          "list is built (was a 2e9-element list, ~16 GB)"),
    ("kvcalc-geometry-bounds", "every geometry number is bounded before use, the message naming the key and the "
                               "range: heads and KV heads 1 .. 10,000, head_dim 1 .. 65,536, width 1 .. 1,048,576, "
                               "max positions and sliding_window up to 10^12, max_window_layers and "
                               "sliding_window_pattern up to 10,000; negative, NaN and Infinity values too"),
    ("kvcalc-count-bounds", "--tokens beyond 10^12, --batch beyond 10^9, --group-size beyond 10^6 (with --kv-bits) "
                            "refused in one line, exit 2; the largest allowed still computes exactly"),
    ("kvcalc-deep-json", "JSON nested 100,000 deep: `JSON nested more than 64 levels deep is beyond what kvcalc "
                         "reads: give at most 64`; 100 deep: `nested 101 levels`; exit 2 (was a RecursionError)"),
    ("kvcalc-huge-json-int", "an integer literal of 5,000 digits in config.json: one line naming the limit, exit 2"),
    ("kvcalc-config-too-big", "a config.json over 16 MiB is refused after reading at most 16 MiB + 1 byte, exit 2"),
    ("kvcalc-memory-overflow", "--memory 1e999999GB: `memory '1e999999GB' is beyond what kvcalc computes: give at most "
                               "1,000,000,000,000,000,000 bytes (1 EB)`, exit 2 (was a decimal overflow)"),
    ("kvcalc-memory-tiny", "--memory 1e-99999GB (less than a byte) refused in one line instead of '0 sequences fit'"),
    ("kvcalc-memory-nonfinite", "--memory inf / nan / NaNGB / -5GB / '' refused in one line, exit 2"),
    ("kvcalc-bad-files", "a folder without config.json, a non-UTF-8 file, an empty file, a FIFO, a name too long for "
                         "the filesystem: one line each that says what the path is and what to pass, exit 2"),
    ("train-sigterm", "SIGTERM to a real `python -m harness.train` mid-training: the step in progress finishes, "
                      "`interrupted by SIGTERM: saved DIR/train_state.pt at step N of M steps; the same command "
                      "resumes from it`, exit 143; the same command prints `resuming at step N`"),
    ("train-stop-signals", "SIGINT, SIGTERM, SIGUSR2 and SIGHUP each mid-step: state saved at the end of that step, "
                           "the line names the signal, exit 130 / 143 / 140 / 129; resumed, the checkpoint is "
                           "bit-identical to an uninterrupted run's"),
    ("train-ctrl-c-honest", "Ctrl-C before the first step: `interrupted by SIGINT (Ctrl-C): stopped before the first "
                            "step was saved; nothing was saved yet, so the same command starts over`, exit 130, no "
                            "file in --out (it used to claim a saved state would resume)"),
    ("train-second-signal", "a second signal stops at once: `stopped at step N at once, nothing new saved; "
                            "DIR/train_state.pt (step K, saved earlier) is kept and the same command resumes from step "
                            "K` (or: nothing was saved, the same command starts over)"),
    ("train-signal-in-export", "a signal while the trained model is evaluated and exported: the state at the last "
                               "step is saved (`training had reached its budget; the same command evaluates and "
                               "writes the checkpoint from it`); the same command writes the same checkpoint"),
    ("train-nohup", "a stop signal the process was started ignoring (nohup's SIGHUP, SIGINT in a background job) "
                    "stays ignored"),
    ("train-signal-while-starting", "a signal while torch loads, before --out is read: one line, exit 128 + n, "
                                    "nothing written"),
    ("train-out-unwritable", "--out under /proc, or under a path whose parent is a file: one line (`--out DIR: cannot "
                             "write there (...)` / `... is a file`), exit 2, before any data is loaded, nothing made"),
    ("train-out-foreign-checkpoint", "--out at a checkpoint folder kvlab did not train (config.json without "
                                     "kvlab_train): one line, exit 2, its files byte for byte as they were"),
    ("train-save-fails", "an OSError while saving (a full disk): `error: cannot write PATH: ...`, exit 1, no "
                         "traceback; the old state file is intact"),
    ("train-threads-bounds", "--threads -1 (was a traceback), 0 (silently every core) or 100,000: `error: --threads N: "
                             "give 1 .. 256 (the CPU threads to train with; this machine has C; leave the flag out to "
                             "use every core)`, exit 2, before any data is loaded"),
    ("train-number-bounds", "--steps 0 or 10**10, --minutes nan / inf / -1 / 1e9, --seed -1 or 2**63, a share flag "
                            "NaN or outside its interval, --copy-offsets nan, --curriculum 32:nan: one line naming "
                            "the flag and its range, exit 2, before torch is asked for threads or data is loaded"),
]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


def kvcalc(argv, capsys) -> tuple[int, str]:
    rc = K.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, (one_line(captured.err) if rc else captured.out)


def config(tmp_path, name="config.json", **fields) -> str:
    base = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "max_position_embeddings": 1024}
    path = tmp_path / name
    path.write_text(json.dumps({**base, **fields}))
    return str(path)


# ---- kvcalc ---------------------------------------------------------------------------------------------------------

def test_kvcalc_huge_layers(tmp_path, capsys):  # kvcalc-huge-layers
    path = config(tmp_path, num_hidden_layers=10 ** 30)
    rc, err = kvcalc([path], capsys)
    assert rc == 2
    assert err == f"kvcalc: error: num_hidden_layers=1e+30 in {path} is beyond what kvcalc computes: give 1 .. 10,000"


@pytest.mark.parametrize("layers, shown", [(2_000_000_000, "2,000,000,000"), (2e9, "2e+09")])
def test_kvcalc_layers_2e9_builds_nothing(tmp_path, capsys, layers, shown):  # kvcalc-layers-2e9
    path = config(tmp_path, num_hidden_layers=layers, sliding_window=4096)
    tracemalloc.start()
    try:
        rc, err = kvcalc([path], capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 2 and f"num_hidden_layers={shown} in {path} is beyond what kvcalc computes: give 1 .. 10,000" in err
    assert peak < 5 * 2 ** 20  # no per-layer list: a 2e9-element one is ~16 GB
    with pytest.raises(K.KVCalcError, match="beyond what kvcalc computes"):
        K.kv_geometry(path)


@pytest.mark.parametrize("fields, says", [
    ({"num_attention_heads": 10 ** 6, "hidden_size": 10 ** 6}, "num_attention_heads=1,000,000 in {} is beyond what "
                                                               "kvcalc computes: give 1 .. 10,000"),
    ({"num_key_value_heads": 10 ** 12}, "num_key_value_heads=1,000,000,000,000 in {} is beyond"),
    ({"head_dim": 2 ** 40}, "head_dim=1,099,511,627,776 in {} is beyond what kvcalc computes: give 1 .. 65,536"),
    ({"hidden_size": 12 * 2 ** 30}, "hidden_size=12,884,901,888 in {} is beyond what kvcalc computes: give 1 .. "
                                    "1,048,576"),
    ({"max_position_embeddings": 10 ** 13}, "max_position_embeddings=10,000,000,000,000 in {} is beyond what kvcalc "
                                            "computes: give 1 .. 1,000,000,000,000"),
    ({"sliding_window": 10 ** 20}, "sliding_window=1e+20 in {} is beyond"),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 10 ** 9},
     "max_window_layers=1,000,000,000 in {} is beyond what kvcalc computes: give 0 .. 10,000"),
    ({"sliding_window": 64, "sliding_window_pattern": 10 ** 9}, "sliding_window_pattern=1,000,000,000 in {} is beyond"),
    ({"num_hidden_layers": -3}, "{}: num_hidden_layers must be a positive integer (at most 10,000), got -3"),
    ({"num_hidden_layers": float("nan")}, "{}: num_hidden_layers must be a positive integer (at most 10,000), got nan"),
    ({"max_position_embeddings": float("inf")}, "max_position_embeddings=inf in {} is beyond"),
    ({"head_dim": 0}, "{}: head_dim must be a positive integer (at most 65,536), got 0"),
])
def test_kvcalc_every_geometry_number_is_bounded(tmp_path, capsys, fields, says):  # kvcalc-geometry-bounds
    path = config(tmp_path, **fields)  # json.dumps writes NaN / Infinity, which Python's json reads back
    rc, err = kvcalc([path], capsys)
    assert rc == 2 and says.format(path) in err


def test_kvcalc_count_bounds_and_the_largest_allowed(capsys):  # kvcalc-count-bounds
    for argv, says in [(["--tokens", 10 ** 13], "tokens=10,000,000,000,000 is beyond what kvcalc computes: give 0 .. "
                                                "1,000,000,000,000"),
                       (["--batch", 10 ** 10], "batch=10,000,000,000 is beyond what kvcalc computes: give 1 .. "
                                               "1,000,000,000"),
                       (["--batch", -1], "batch must be a positive integer"),
                       (["--tokens", "nan"], "invalid int value: 'nan'"),
                       (["--kv-bits", "4,4", "--group-size", 10 ** 7], "group_size=10,000,000 is beyond"),
                       (["--kv-bits", "4,4", "--group-size", 0], "group_size must be an integer >= 1")]:
        rc, err = kvcalc(["gpt2", *argv], capsys)
        assert rc == 2 and says in err, (argv, err)
    # at the bounds the arithmetic is still exact (Python integers): 73,728 B/token x 10^12 tokens x 10^9 batch
    rc, out = kvcalc(["gpt2", "--tokens", 10 ** 12, "--batch", 10 ** 9, "--memory", "1e18", "--json"], capsys)
    r = json.loads(out)
    assert rc == 0 and r["bytes"] == 73_728 * 10 ** 21 and r["sequences_that_fit"] == 10 ** 18 // (73_728 * 10 ** 12)


@pytest.mark.parametrize("depth, says", [(100_000, "JSON nested more than 64 levels deep is beyond what kvcalc "
                                                   "reads: give at most 64"),
                                         (100, "JSON nested 101 levels deep is beyond what kvcalc reads: give at most "
                                               "64")])
def test_kvcalc_deep_json(tmp_path, capsys, depth, says):  # kvcalc-deep-json
    path = tmp_path / "deep.json"
    path.write_text('{"n_layer": 2, "n_head": 2, "n_embd": 64, "x": ' + "[" * depth + "]" * depth + "}")
    rc, err = kvcalc([path], capsys)
    assert rc == 2 and err.startswith(f"kvcalc: error: {path}: ") and says in err
    ok = tmp_path / "ok.json"  # HF's own nesting (a dict inside a dict) is fine
    ok.write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 8,
                              "rope_scaling": {"type": "yarn", "factors": [[1, 2], [3]]}}))
    assert kvcalc([ok], capsys)[0] == 0


def test_kvcalc_huge_json_integer_and_big_file(tmp_path, capsys, monkeypatch):  # kvcalc-huge-json-int, kvcalc-config-too-big
    path = tmp_path / "big.json"
    path.write_text('{"n_layer": ' + "9" * 5000 + ', "n_head": 2, "n_embd": 64}')
    rc, err = kvcalc([path], capsys)
    assert rc == 2 and "cannot read its JSON" in err and "4300 digits" in err
    monkeypatch.setattr(K, "MAX_CONFIG_BYTES", 100)
    path.write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 64, "pad": "x" * 200}))
    rc, err = kvcalc([path], capsys)
    assert rc == 2 and "more than 100 bytes, larger than kvcalc reads" in err


@pytest.mark.parametrize("memory, says", [
    ("1e999999GB", "memory '1e999999GB' is beyond what kvcalc computes: give at most 1,000,000,000,000,000,000 bytes "
                   "(1 EB)"),
    ("2EiB", "cannot read memory"),  # no such unit
    ("1.1e18", "is beyond what kvcalc computes"),
    ("1e-99999GB", "memory '1e-99999GB' is less than 1 byte"),
    ("0.5", "is less than 1 byte"),
    ("inf", "cannot read memory 'inf'"),
    ("nan", "cannot read memory 'nan'"),
    ("NaNGB", "cannot read memory"),
    ("-5GB", "cannot read memory"),
    ("", "cannot read memory"),
    ("1" * 500, "cannot read memory"),
])
def test_kvcalc_memory_is_bounded(capsys, memory, says):  # kvcalc-memory-overflow, kvcalc-memory-tiny,
    # kvcalc-memory-nonfinite
    rc, err = kvcalc(["gpt2", f"--memory={memory}"], capsys)
    assert rc == 2 and says in err
    with pytest.raises(K.KVCalcError):
        K.parse_memory(memory)


def test_kvcalc_memory_at_the_bound():
    assert K.parse_memory("1e18") == K.parse_memory("1000000TB") == 10 ** 18
    with pytest.raises(K.KVCalcError, match="beyond what kvcalc computes"):
        K.parse_memory("1000001TB")


def test_kvcalc_bad_files(tmp_path, capsys):  # kvcalc-bad-files
    folder = tmp_path / "folder"
    folder.mkdir()
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"n_layer": 2, "name": "caf\xe9"}')
    at = bad.read_bytes().index(b"\xe9")
    empty = tmp_path / "empty.json"
    empty.write_text("  \n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for arg, says in [(folder, f"{str(folder)!r}: a folder without a config.json; pass a preset name, an HF "
                               "config.json or a folder holding one"),
                      (bad, f"{bad}: not UTF-8 text (byte {at}: invalid continuation byte)"),
                      (empty, f"{empty}: is empty; pass an HF config.json"),
                      (fifo, f"{str(fifo)!r}: not a regular file"),
                      ("x" * 5000, "not a path this system can open (File name too long)")]:
        rc, err = kvcalc([arg], capsys)
        assert rc == 2 and says in err, (arg, err)
        assert len(err) < 400


@pytest.mark.slow
def test_kvcalc_cases_as_a_script(tmp_path):  # the module's own command line: exit codes and stderr
    huge = config(tmp_path, "huge.json", num_hidden_layers=10 ** 30)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for argv in ([huge], [str(deep)], ["gpt2", "--memory", "1e999999GB"]):
        p = subprocess.run([sys.executable, "-m", "harness.kvcalc", *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and p.stdout == "" and "beyond what kvcalc" in one_line(p.stderr)


# ---- train: stop signals ------------------------------------------------------------------------------------------

SMALL = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)
FAST = dict(config=SMALL, batch=8, seq_len=32, eval_tokens=1024, eval_every=1000, progress=False)  # one quick eval


@pytest.fixture(autouse=True)
def quick_eval_small(monkeypatch):
    monkeypatch.setattr(train_corpus, "EVAL_TOKENS", 256)  # the held-out check in training only: weights unchanged


def signal_on_call(monkeypatch, module, name, n, signums):
    """Make <module>.<name>'s n-th call send ``signums`` to this process first (a signal that lands mid-step)."""
    real, calls = getattr(module, name), [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            for s in signums:
                os.kill(os.getpid(), s)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    return out, train_loop.train(out, steps=6, **FAST)


def stopped_mid_step(out, monkeypatch, signum, at_call=3) -> signals.Interrupted:
    """train() stopped by ``signum`` sent from inside step ``at_call`` (lr_at is called once at the start of each
    step); the Interrupted it raised."""
    signal_on_call(monkeypatch, train_loop, "lr_at", at_call, [signum])
    with signals.stop_signals(), pytest.raises(signals.Interrupted) as e:
        train_loop.train(out, steps=6, **FAST)
    monkeypatch.undo()
    return e.value


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP],
                         ids=lambda s: signal.Signals(s).name)
@pytest.mark.slow
def test_each_stop_signal_saves_the_step_it_lands_in(tmp_path, monkeypatch, signum):  # train-stop-signals
    out = tmp_path / "run"
    e = stopped_mid_step(out, monkeypatch, signum)
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    assert e.exit_code == 128 + signum and e.signum == signum
    assert e.message == f"{name}: saved {out / STATE} at step 3 of 6 steps; the same command resumes from it"
    assert torch.load(out / STATE, weights_only=True)["step"] == 3
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, STATE]  # nothing else, no temporary file
    assert signal.getsignal(signum) is not signals.raise_interrupted  # the handlers are put back


@pytest.mark.slow
def test_after_restart_the_line_says_resume_without_it(tmp_path, monkeypatch):  # train-stop-signals
    out = tmp_path / "run"
    signal_on_call(monkeypatch, train_loop, "lr_at", 2, [signal.SIGTERM])
    with signals.stop_signals(), pytest.raises(signals.Interrupted) as e:
        train_loop.train(out, steps=6, restart=True, **FAST)
    assert e.value.message == (f"SIGTERM: saved {out / STATE} at step 2 of 6 steps; the same command without "
                               "--restart resumes from it")


def test_an_ignored_signal_stays_ignored():  # train-nohup
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a process
    try:
        with signals.stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is signals.raise_interrupted
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.slow
def test_resumed_after_a_signal_it_ends_where_an_uninterrupted_run_does(tmp_path, monkeypatch, whole):
    out = tmp_path / "run"  # train-stop-signals
    stopped_mid_step(out, monkeypatch, signal.SIGTERM)
    resumed = train_loop.train(out, steps=6, **FAST)
    a, b = load_file(str(whole[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert resumed["done"] and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["heldout_nll"] == whole[1]["heldout_nll"] and not (out / STATE).exists()


def test_ctrl_c_before_the_first_step_says_nothing_was_saved(tmp_path, monkeypatch, capsys):  # train-ctrl-c-honest
    out = tmp_path / "run"
    signal_on_call(monkeypatch, train_corpus, "load_data", 1, [signal.SIGINT])
    assert train_cli.main(["--out", str(out), "--steps", "5"]) == 130
    assert one_line(capsys.readouterr().err) == ("interrupted by SIGINT (Ctrl-C): stopped before the first step was "
                                                 "saved; nothing was saved yet, so the same command starts over")
    assert list(out.iterdir()) == []
    # without stop_signals (train() as a library call), Ctrl-C is a KeyboardInterrupt: the same honest Interrupted
    signal_on_call(monkeypatch, train_corpus, "load_data", 1, [signal.SIGINT])
    with pytest.raises(signals.Interrupted, match="nothing was saved yet") as e:
        train_loop.train(out, steps=5, **FAST)
    assert e.value.exit_code == 130


@pytest.mark.slow  # seconds: not in make test-fast
def test_a_second_signal_stops_at_once_and_names_the_earlier_state(tmp_path, monkeypatch):  # train-second-signal
    out = tmp_path / "run"
    # two different signals (the lower number first: the order Python runs pending handlers in), so neither can
    # merge into the other; the first one is named
    signal_on_call(monkeypatch, train_loop, "lr_at", 2, [signal.SIGUSR2, signal.SIGTERM])
    with signals.stop_signals(), pytest.raises(signals.Interrupted) as e:
        train_loop.train(out, steps=6, **FAST)
    assert e.value.exit_code == 140 and e.value.message == ("SIGUSR2: stopped at once at step 1, before any state was "
                                                            "saved; nothing was saved, so the same command starts over")
    assert not (out / STATE).exists()
    monkeypatch.undo()
    signal_on_call(monkeypatch, train_loop, "lr_at", 3, [signal.SIGTERM])
    with signals.stop_signals(), pytest.raises(signals.Interrupted):
        train_loop.train(out, steps=6, **FAST)  # saved at step 3
    monkeypatch.undo()
    signal_on_call(monkeypatch, train_loop, "lr_at", 2, [signal.SIGHUP, signal.SIGINT])  # inside step 5 (resumed at 3)
    with signals.stop_signals(), pytest.raises(signals.Interrupted) as e:
        train_loop.train(out, steps=6, **FAST)
    assert e.value.exit_code == 129 and e.value.message == (
        f"SIGHUP: stopped at step 4 at once, nothing new saved; {out / STATE} (step 3, saved earlier) is kept and "
        "the same command resumes from step 3")
    assert torch.load(out / STATE, weights_only=True)["step"] == 3


@pytest.mark.slow
def test_a_signal_during_export_saves_the_last_step(tmp_path, monkeypatch, whole):  # train-signal-in-export
    out = tmp_path / "run"
    signal_on_call(monkeypatch, train_loop, "export_full", 1, [signal.SIGTERM])
    with signals.stop_signals(), pytest.raises(signals.Interrupted) as e:
        train_loop.train(out, steps=6, **FAST)
    assert e.value.exit_code == 143 and e.value.message == (
        f"SIGTERM: saved {out / STATE} at step 6 of 6 steps; training had reached its budget; the same command "
        "evaluates and writes the checkpoint from it")
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, STATE]
    monkeypatch.undo()
    again = train_loop.train(out, steps=6, **FAST)
    a, b = load_file(str(whole[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert again["done"] and all(torch.equal(a[k], b[k]) for k in a) and not (out / STATE).exists()


def test_a_failed_save_is_one_line_exit_1(tmp_path, monkeypatch, capsys):  # train-save-fails
    out = tmp_path / "run"
    real_train = train_loop.train  # main() with the small config: the error handling is main's
    monkeypatch.setattr(train_cli, "train", lambda out, **kw: real_train(out, **kw, **FAST))
    assert train_cli.main(["--out", str(out), "--steps", "3", "--stop-after", "1"]) == 0
    before = (out / STATE).read_bytes()

    def full_disk(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(train_loop, "atomic_write", full_disk)
    assert train_cli.main(["--out", str(out), "--steps", "3", "--stop-after", "1"]) == 1
    assert one_line(capsys.readouterr().err) == (f"error: cannot write {out / STATE}: No space left on device; free "
                                                 "space or give another --out")
    assert (out / STATE).read_bytes() == before


def test_out_unwritable_is_one_line_before_any_data(tmp_path, monkeypatch, capsys):  # train-out-unwritable
    def no_data():
        raise AssertionError("data loaded before --out was checked")

    monkeypatch.setattr(train_corpus, "load_data", no_data)
    parent_file = tmp_path / "a-file"
    parent_file.write_text("x")
    for out, says in [("/proc/kvlab-test/run", "--out /proc/kvlab-test/run: cannot write there (/proc/kvlab-test: "),
                      (parent_file / "sub" / "run", f"--out {parent_file / 'sub' / 'run'}: {parent_file} is a file, so "
                                                    "no folder can be made under it; give a folder path")]:
        assert train_cli.main(["--out", str(out), "--steps", "3"]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("error: " + says), line
    assert not os.path.exists("/proc/kvlab-test") and parent_file.read_text() == "x"


def _cli(out, *extra):
    return [sys.executable, "-m", "harness.train", "--out", str(out), "--steps", "1000", "--stop-after", "2", *extra]


def _last_line(stderr: str) -> str:  # tqdm redraws its bar with \r on stderr; the last line is kvlab's
    lines = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip()]
    assert "Traceback" not in stderr and lines, stderr
    return lines[-1]


@pytest.mark.slow
def test_sigterm_to_a_real_run_saves_and_the_same_command_resumes(tmp_path):  # train-sigterm
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen(_cli(out), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:  # "step 0: ..." is printed once the model exists, just before the first step
            if line.startswith("step 0:"):
                break
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 143, stderr
    last = _last_line(stderr)
    assert last == (f"interrupted by SIGTERM: saved {out / STATE} at step 1 of 1000 steps; the same command resumes "
                    "from it")
    assert sum("SIGTERM" in ln for ln in stderr.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, STATE]
    again = subprocess.run(_cli(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{out}: resuming at step 1 " in again.stdout and f"{out}: stopped at step 3 of the budget" in again.stdout
    assert torch.load(out / STATE, weights_only=True)["step"] == 3


@pytest.mark.slow
def test_a_signal_while_starting_is_one_line(tmp_path):  # train-signal-while-starting
    out = tmp_path / "run"
    p = subprocess.Popen(_cli(out), cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # torch is still loading (or, on a fast machine, the corpus is): nothing trained either way
    p.send_signal(signal.SIGUSR2)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 140
    line = _last_line(stderr)
    assert line.startswith("interrupted by SIGUSR2: stopped") and "nothing was saved" in line, line
    assert not out.exists() or list(out.iterdir()) == []


def test_a_checkpoint_kvlab_did_not_train_is_never_overwritten(tmp_path, monkeypatch, capsys):  # train-out-foreign-checkpoint
    def no_data():
        raise AssertionError("data loaded before --out was checked")

    monkeypatch.setattr(train_corpus, "load_data", no_data)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    (tmp_path / "model.safetensors").write_bytes(b"their weights")
    for extra in ([], ["--restart"]):
        assert train_cli.main(["--out", str(tmp_path), "--steps", "2", *extra]) == 2
        line = one_line(capsys.readouterr().err)
        assert "holds a checkpoint kvlab did not train" in line, line
    assert (tmp_path / "model.safetensors").read_bytes() == b"their weights"
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("argv, says", [
    (["--threads", "-1"], "--threads -1: give 1 .. "),
    (["--threads", "0"], "--threads 0: give 1 .. "),
    (["--threads", "100000"], "--threads 100000: give 1 .. "),
])
def test_threads_out_of_range_is_one_line_before_any_data(tmp_path, monkeypatch, capsys, argv, says):
    # train-threads-bounds
    def no_data():
        raise AssertionError("data loaded before the flags were checked")

    monkeypatch.setattr(train_corpus, "load_data", no_data)
    monkeypatch.setattr(torch, "set_num_threads", no_data)
    assert train_cli.main(["--out", str(tmp_path / "run"), "--steps", "3", *argv]) == 2
    line = one_line(capsys.readouterr().err)
    cores = train_cli._cores()
    most = max(MAX_THREADS, cores)
    assert line == (f"error: {says}{most:,} (the CPU threads to train with; this machine has {cores}; leave the "
                    "flag out to use every core) (see python -m harness.train --help)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps 0: give 1 .. 1,000,000 (the step budget; the shipped model took 3,200)"),
    (["--steps", str(10 ** 10)], "--steps 10,000,000,000: give 1 .. 1,000,000"),
    (["--minutes", "nan"], "--minutes nan: give a number of minutes more than 0 and at most 10,080"),
    (["--minutes", "inf"], "--minutes inf: give a number of minutes more than 0 and at most 10,080"),
    (["--minutes", "-1"], "--minutes -1: give a number of minutes"),
    (["--minutes", "1e9"], "--minutes 1e+09: give a number of minutes"),
    (["--seed", "-1"], "--seed -1: use an integer 0 <= seed < 2**63"),
    (["--seed", str(2 ** 63)], f"--seed {2 ** 63}: use an integer 0 <= seed < 2**63"),
    (["--copy-share", "nan"], "--copy-share nan: give a share in [0, 1]"),
    (["--mlp-off", "1"], "--mlp-off 1: give a share in [0, 1)"),
    (["--placed-share", "-0.1"], "--placed-share -0.1: give a share in [0, 1]"),
    (["--text-spans", "1.5"], "--text-spans 1.5: give a share in [0, 1]"),
    (["--needle-share", "nan"], "--needle-share nan: give a share in [0, 1]"),
    (["--question-tail", "0.6"], "--question-tail 0.6: give a share in [0, 0.5]"),
    (["--copy-phase", "inf"], "--copy-phase inf: give a share in [0, 1)"),
    (["--copy-offsets", "nan"], "--copy-offsets nan: give a share in [0, --copy-phase 0.315) or none"),
    (["--curriculum", "32:nan"], "--curriculum 32:nan: a length must be >= 2"),
    (["--steps", "5", "--minutes", "3"], "give one budget: --minutes or --steps, not both"),
])
def test_every_number_is_bounded_before_any_data(tmp_path, monkeypatch, capsys, argv, says):  # train-number-bounds
    def no_data():
        raise AssertionError("data loaded before the flags were checked")

    monkeypatch.setattr(train_corpus, "load_data", no_data)
    monkeypatch.setattr(torch, "set_num_threads", no_data)
    extra = [] if "--steps" in argv or "--minutes" in argv else ["--steps", "3"]
    assert train_cli.main(["--out", str(tmp_path / "run"), *extra, *argv]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: {says}") and line.endswith("(see python -m harness.train --help)"), line
    assert not (tmp_path / "run").exists()
