"""Issue 44, second pass: every input that scales is bounded before it is read or allocated, and a missing service or
a bad flag is one line that says what to do. ``python -m harness.bench`` bounds its counts and checks memory before
it builds a model; ``python run.py -m hydra/launcher=slurm...`` checks that Slurm answers before any folder is made
(harness/experiment/slurm_check.py; here against stand-in Slurm commands, tests/experiment/test_slurm.py against a
real cluster); run.py says one line for a bad flag and for a signal while it starts; the scripts run from a fresh
clone without the virtualenv activated. ``CASES`` lists each case with what kvlab now does."""

import argparse
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.tools import bench
from harness.experiment import memory
from harness.experiment import slurm_check as S
from models.gpt2 import GPT2Config
from tests.helpers import REPO, TINY, one_line, untested_cases
from tests.helpers import bench_args, bench_refused as refused

CASES = [
    ("bench-batch-bound", "`python -m harness.bench --batch 100000000`: `bench: error: --batch 100,000,000 is "
                          "beyond what the benchmark runs: give 1 .. 65,536 (...)`, exit 2, before a model is built "
                          "(was 10 GB, then a traceback)"),
    ("bench-memory", "`python -m harness.bench --kinds --batch 5000`: `... needs about N GB (weights, caches, "
                     "transients) but this machine has M GB free (...): --batch <= B would fit, or use a smaller "
                     "--model ...`, exit 2, before a model is built; scripts/gpu-check makes the same check against "
                     "the GPU"),
    ("bench-count-bounds", "--repeats beyond 10,000, --warmup beyond 1,000 (a run's caps), more than 64 --contexts "
                           "/ --prefixes / --cache, --seed outside 0 .. 2**63 - 1: one line each, exit 2; gpu-check "
                           "bounds its --batch, --repeats, --warmup, lists, --budget-s and --card-gbps (NaN too) alike"),
    ("bench-bad-flags", "two of --kinds / --prefix / --paged, a flag of another mode (--prompt-max without --paged, "
                        "--contexts with --prefix), a malformed --cache value, an argparse error: one line, exit 2 "
                        "(argparse printed its usage first)"),
    ("bench-cache-spec", "--cache snapkv with contexts shorter than its window, a kind without ragged batches under "
                         "--paged, a paged pool too small: one line, exit 2 (were tracebacks mid-benchmark)"),
    ("slurm-conf-missing", "`SLURM_CONF=/nonexistent python run.py -m hydra/launcher=slurm_cpu ...`: `kvlab: "
                           "hydra/launcher=slurm_cpu submits each run to Slurm, but SLURM_CONF=... does not exist; "
                           "nothing was written: start a one-node cluster with scripts/slurm-up DIR ...`, exit 2, no "
                           "sweep folder (was ~40 lines of traceback, a manifest, multirun.yaml and .submitit/)"),
    ("slurm-no-commands", "no sbatch / srun / sacct / scontrol on PATH: the same line naming them"),
    ("slurm-controller-down", "the controller does not answer (`scontrol ping` DOWN, no configuration source, or no "
                              "answer within KVLAB_SLURM_TIMEOUT seconds): the same line with Slurm's reason"),
    ("slurm-partition-unknown", "`hydra.launcher.partition=X` the cluster lacks, or none given and no default "
                                "partition: one line naming the partitions it has, exit 2, nothing written"),
    ("slurm-gpu-on-cpu-nodes", "`hydra/launcher=slurm` (one GPU per job) on a cluster whose partition has no GPU "
                               "node: one line saying to use hydra/launcher=slurm_cpu, exit 2, nothing written"),
    ("run-signal-while-starting", "SIGTERM, SIGINT, SIGHUP or SIGUSR2 while run.py imports torch and Hydra: `kvlab: "
                                  "interrupted (SIGTERM) while starting; nothing was written`, exit 128 + n, no run "
                                  "folder"),
    ("run-bad-flags", "`python run.py --resolve`, `-m --cfg job`, `--bogus`, `--cfg` without a value: one line, exit "
                      "2 (were tracebacks or Hydra's usage)"),
    ("scripts-without-venv", "`scripts/gpu-check --help` (and the probes) from a Python without torch: run again "
                             "with the repo's .venv/bin/python; with no virtualenv: `scripts/gpu-check: ... cannot "
                             "import torch, pandas and there is no virtualenv at REPO/.venv: run `make setup` in "
                             "REPO, then scripts/gpu-check again`, exit 2"),
    ("remeasure-mini-no-python", "`PY=/nonexistent scripts/remeasure-mini OUT`, an unknown ONLY name or two "
                                 "arguments: one line, exit 2, OUT not made (was one failed sweep after another)"),
    ("slurm-up-dir-unwritable", "`scripts/slurm-up FILE/x`: `slurm-up: cannot make or write ...: give another "
                                "DIR`, exit 1, before anything is installed or started"),
    ("remeasure-mini-help", "`scripts/remeasure-mini --help` (-h): its usage from the header comment and the sweeps' "
                            "names, exit 0, nothing run or made (was mkdir's help, then all 19 sweeps into a folder "
                            "named --help/); `scripts/remeasure-mini -x`: `remeasure-mini: no option -x: usage: "
                            "scripts/remeasure-mini [OUT] (...)`, exit 2, nothing made"),
    ("slurm-scripts-help", "`scripts/slurm-up --help`, `scripts/slurm-down --help` (-h): the usage, exit 0, nothing "
                           "resolved, made or started (were 20 garbled lines of realpath's help; as root slurm-up went "
                           "on); any other -argument: `slurm-up: no option -x: usage: scripts/slurm-up DIR (...)`, "
                           "exit 2; DIR is passed as `realpath -m -- DIR`"),
    ("remeasure-mini-quanto-layout", "remeasure-mini's quanto4 / quanto2 sweeps run `engine=kvlab,hf "
                                     "cache=quant/token`: one layout (K per token) on both engines; were "
                                     "`cache=quant`, which engine=hf now refuses (K per channel)"),
    ("measurements-doc-unwritable", "`python -m harness.measurements --doc /proc/x` (or a folder, a missing folder, "
                                    "a device): `python -m harness.measurements: error: --doc /proc/x: cannot write "
                                    "a file in /proc (...)`, exit 2, nothing written (were FileNotFoundError / "
                                    "IsADirectoryError tracebacks); the file is written atomically"),
    ("wandb-report-timeout", "`python -m harness.wandb_report GROUP --timeout nan` (-1, 0, 1e308, inf, abc): "
                             "`kvlab wandb_report: --timeout nan: give the seconds each W&B call may take, a number in "
                             "(0, 600]`, exit 2, before W&B is asked (was `not logged in` or an OverflowError); "
                             "--entity / --project that cannot name one, an empty --spec-only / --from-spec, an "
                             "argparse error: one line, exit 2"),
]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


# ---- bench ---------------------------------------------------------------------------------------------------------

def test_bench_batch_is_bounded_before_anything_is_built(no_model, capsys):  # bench-batch-bound
    assert refused(["--batch", "100000000"], capsys) == (
        "--batch 100,000,000 is beyond what the benchmark runs: give 1 .. 65,536 (sequences decoded or requests "
        "served together)")
    assert "--batch 65,537 is beyond" in refused(["--kinds", "--batch", "65537"], capsys)


@pytest.mark.slow
def test_bench_batch_as_a_script_is_one_line_exit_2():  # bench-batch-bound
    p = subprocess.run([sys.executable, "-m", "harness.bench", "--batch", "100000000"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "--batch 100,000,000 is beyond" in one_line(p.stderr)


def _args(argv: list[str]) -> tuple[argparse.Namespace, GPT2Config]:
    """The benchmark's arguments as main() checks them (nothing built)."""
    return bench_args(argv)


def test_bench_memory_is_checked_and_names_the_largest_batch_that_fits(no_model, monkeypatch, capsys):  # bench-memory
    free = 24 * 10 ** 9
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": free)
    line = refused(["--kinds", "--batch", "5000"], capsys)
    assert line.startswith("the benchmark (--kinds, --model gpt2, fp32, batch 5000) needs about ")
    assert f"but this machine has {memory.size(free)} free" in line and line.endswith(
        "use a smaller --model, fewer --cache kinds or shorter --contexts")
    fits = int(line.split("--batch <= ")[1].split()[0])
    args, cfg = _args(["--kinds", "--batch", "5000"])
    args.contexts = [32, 128, 512, 960]
    budget = memory.usable(free)
    assert sum(bench.bench_bytes(args, cfg, fits).values()) <= budget < sum(bench.bench_bytes(args, cfg,
                                                                                             fits + 1).values())


def test_bench_memory_estimate_counts_at_least_the_caches_built(tiny_model):  # bench-memory
    """The estimate's cache term against the bytes the caches --kinds builds really hold (time_kinds' own count)."""
    args, cfg = _args(["--model", "tiny", "--kinds", "--batch", "3", "--contexts", "40",
                       "--cache", "prealloc", "--cache", "quant:k_bits=4,v_bits=4", "--cache", "paged"])
    bench.check_args(argparse.ArgumentParser(), args, cfg)
    specs = [bench.parse_kind(k) for k in args.cache]
    from harness.core.engines import KvlabEngine

    _, held = bench.time_kinds(KvlabEngine(tiny_model), specs, 40, cfg.n_positions, repeats=1, warmup=0, batch=3)
    need = bench.bench_bytes(args, cfg)
    assert need["cache"] >= sum(held.values()) > 0
    assert need["weights"] == 4 * sum(p.numel() for p in tiny_model.parameters())


@pytest.mark.parametrize("argv, says", [
    (["--repeats", "10001"], "--repeats 10,001 is beyond what the benchmark runs: give 1 .. 10,000"),
    (["--warmup", "1001"], "--warmup 1,001 is beyond what the benchmark runs: give 0 .. 1,000"),
    (["--kinds", "--contexts", *map(str, range(1, 71))], "--contexts has 70 entries: give at most 64"),
    (["--prefix", "--prefixes", *map(str, range(1, 66))], "--prefixes has 65 entries: give at most 64"),
    (["--kinds", *["--cache", "prealloc"] * 65], "--cache has 65 entries: give at most 64"),
    (["--seed", "-1"], "--seed -1: use an integer 0 <= seed < 2**63"),
    (["--seed", str(2 ** 63)], "use an integer 0 <= seed < 2**63"),
    (["--repeats", "nan"], "argument --repeats: invalid int value: 'nan'"),
])
def test_bench_counts_are_bounded(no_model, capsys, argv, says):  # bench-count-bounds
    assert says in refused(argv, capsys)


@pytest.mark.parametrize("argv, says", [
    (["--kinds", "--prefix"], "--kinds and --prefix: give one of --kinds, --prefix, --paged"),
    (["--prompt-max", "5"], "--prompt-max is for --paged"),
    (["--suffix", "5"], "--suffix is for --prefix"),
    (["--prefix", "--contexts", "32"], "--contexts is for --kinds and the HF comparison"),
    (["--kinds", "--cache", "quant:k_bits=x"], "--cache 'quant:k_bits=x': k_bits='x' is not a int"),
    (["--kinds", "--cache", "lru"], "unknown cache kind 'lru'"),
    (["--model", "gpt5"], "argument --model: invalid choice: 'gpt5'"),
])
def test_bench_bad_flags_are_one_line(no_model, capsys, argv, says):  # bench-bad-flags
    assert says in refused(argv, capsys)


@pytest.mark.parametrize("argv, says", [
    (["--model", "tiny", "--kinds", "--contexts", "16"],
     "--cache snapkv B256 window=32 kernel=5: this kind needs prompts of at least 32 tokens (its window), but "
     "--contexts has 16: lower its window, or give 32 or more"),
    (["--model", "tiny", "--paged", "--cache", "quant", "--prompt-max", "30", "--output-max", "10"],
     "--paged serves a ragged batch, and cache kind 'quant' does not run ragged batches"),
    (["--model", "tiny", "--paged", "--cache", "snapkv", "--prompt-max", "30", "--output-max", "10"],
     "but --paged draws prompts of 1 .. 30 tokens: lower its window"),
    (["--model", "tiny", "--kinds", "--contexts", "40", "--cache", "paged:blocks=1"],
     "cache option blocks=1 is too few for this run"),
])
def test_bench_cache_specs_the_mode_cannot_run_are_refused_first(no_model, capsys, argv, says):  # bench-cache-spec
    assert says in refused(argv, capsys)


# ---- Slurm, with stand-in commands ---------------------------------------------------------------------------------

PARTITIONS = "PartitionName=debug Default=YES State=UP Nodes=n1\nPartitionName=big Default=NO State=UP Nodes=n1\n"
NODES = "NodeName=n1 CPUs=2 Gres=(null) State=IDLE Partitions=debug,big\n"


def fake_slurm(tmp_path, ping_rc=0, ping_out="Slurmctld(primary) at n1 is UP", partitions=PARTITIONS, nodes=NODES,
               ping_sleep=0, leave_out=()) -> dict:
    """An environment whose PATH holds stand-in Slurm client commands (and nothing else of Slurm's) and whose
    SLURM_CONF is a file: scontrol answers ping / show partition / show node as told; sbatch records a call."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    calls = tmp_path / "calls"
    script = {
        "scontrol": f"""#!/bin/sh
echo "scontrol $*" >> {calls}
case "$1 $2" in
  "ping "*) {f"exec sleep {ping_sleep}" if ping_sleep else f"echo '{ping_out}'; exit {ping_rc}"} ;;
  "show partition") printf '{partitions}' ;;
  "show node") printf '{nodes}' ;;
esac
""",
        "sbatch": f"#!/bin/sh\necho \"sbatch $*\" >> {calls}\nexit 1\n",
        "srun": "#!/bin/sh\nexit 1\n",
        "sacct": "#!/bin/sh\nexit 1\n",
    }
    for name, text in script.items():
        if name in leave_out:
            continue
        path = bin_ / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (bin_ / "sleep").symlink_to(shutil.which("sleep"))  # PATH holds these alone: no real Slurm command is found
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=fake\n")
    return {**os.environ, "PATH": f"{bin_}:{Path(sys.executable).parent}", "SLURM_CONF": str(conf),
            "KVLAB_SLURM_TIMEOUT": "2"}


def no_slurm_path() -> str:
    """A PATH with this Python and the basic tools but none of Slurm's commands."""
    return f"{Path(sys.executable).parent}:" + ":".join(
        d for d in ("/bin", "/usr/bin") if not any((Path(d) / c).exists() for c in S.COMMANDS))


def sweep(tmp_path, env, *extra, launcher="slurm_cpu") -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "run.py", "-m", f"hydra/launcher={launcher}", "cache=concat,prealloc", *TINY,
                        "tracking=disabled", f"hydra.sweep.dir={folder}", *extra], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    return p, folder


TODO = ("nothing was written: start a one-node cluster with `scripts/slurm-up DIR` and export the SLURM_CONF=... it "
        "prints, point SLURM_CONF at your cluster's slurm.conf (with sbatch, srun, sacct and scontrol on PATH), or "
        "leave out hydra/launcher=slurm_cpu to run the sweep on this machine")


def test_a_missing_slurm_conf_is_one_line_and_nothing_is_written(tmp_path):  # slurm-conf-missing
    env = {**fake_slurm(tmp_path), "SLURM_CONF": str(tmp_path / "nonexistent.conf")}
    p, folder = sweep(tmp_path, env)
    assert p.returncode == 2 and p.stdout == ""
    assert one_line(p.stderr) == (f"kvlab: hydra/launcher=slurm_cpu submits each run to Slurm, but SLURM_CONF="
                                  f"{tmp_path / 'nonexistent.conf'} does not exist; {TODO}")
    assert not folder.exists() and not (tmp_path / "calls").exists()  # nothing asked of Slurm, nothing made
    env["SLURM_CONF"] = str(tmp_path)
    assert "is a folder, not a slurm.conf" in S.problem(env=env)


def test_no_slurm_commands_on_path_is_one_line(tmp_path):  # slurm-no-commands
    env = {**os.environ, "PATH": no_slurm_path()}
    env.pop("SLURM_CONF", None)
    p, folder = sweep(tmp_path, env)
    assert p.returncode == 2 and not folder.exists()
    assert one_line(p.stderr) == ("kvlab: hydra/launcher=slurm_cpu submits each run to Slurm, but sbatch, srun, "
                                  f"sacct, scontrol are not on PATH (Slurm's client commands); {TODO}")
    env = fake_slurm(tmp_path, leave_out=("srun",))
    assert S.problem(env=env) == "srun is not on PATH (Slurm's client commands)"


@pytest.mark.parametrize("how, says", [
    (dict(ping_rc=1, ping_out="Slurmctld(primary) at n1 is DOWN"),
     "the Slurm controller does not answer (`scontrol ping`: Slurmctld(primary) at n1 is DOWN)"),
    (dict(ping_rc=1, ping_out="scontrol: fatal: Could not establish a configuration source"),
     "the Slurm controller does not answer (`scontrol ping`: scontrol: fatal: Could not establish a configuration "
     "source)"),
    (dict(ping_sleep=30), "the Slurm controller did not answer `scontrol ping` within 2 s (KVLAB_SLURM_TIMEOUT)"),
])
def test_a_controller_that_does_not_answer_is_one_line(tmp_path, how, says):  # slurm-controller-down
    p, folder = sweep(tmp_path, fake_slurm(tmp_path, **how))
    assert p.returncode == 2 and not folder.exists()
    assert one_line(p.stderr) == f"kvlab: hydra/launcher=slurm_cpu submits each run to Slurm, but {says}; {TODO}"
    assert "sbatch" not in (tmp_path / "calls").read_text()  # nothing was submitted


def test_the_timeout_itself_is_bounded(tmp_path):  # slurm-controller-down
    for bad in ("nan", "-1", "0", "1e9", "soon"):
        env = {**fake_slurm(tmp_path / bad), "KVLAB_SLURM_TIMEOUT": bad}
        assert S.problem(env=env).startswith(f"KVLAB_SLURM_TIMEOUT={bad!r}: give the seconds a Slurm command may take")


def test_an_unknown_or_missing_partition_is_one_line(tmp_path):  # slurm-partition-unknown
    p, folder = sweep(tmp_path, fake_slurm(tmp_path), "hydra.launcher.partition=gpu")
    assert p.returncode == 2 and not folder.exists()
    assert one_line(p.stderr) == ("kvlab: hydra/launcher=slurm_cpu submits each run to Slurm, but the cluster has no "
                                  "partition 'gpu' (hydra.launcher.partition); nothing was written: give "
                                  "hydra.launcher.partition= one of debug, big")
    no_default = PARTITIONS.replace("Default=YES", "Default=NO")
    env = fake_slurm(tmp_path / "b", partitions=no_default)
    assert S.problem(S.launcher_settings("slurm_cpu", []), env) == (
        "no partition is given and the cluster has no default one")
    assert S.problem(S.launcher_settings("slurm_cpu", ["hydra.launcher.partition=big"]), env) is None


def test_a_gpu_launcher_on_a_cluster_without_gpus_is_one_line(tmp_path):  # slurm-gpu-on-cpu-nodes
    env = fake_slurm(tmp_path)
    p, folder = sweep(tmp_path, env, launcher="slurm")
    assert p.returncode == 2 and not folder.exists()
    assert one_line(p.stderr) == (
        "kvlab: hydra/launcher=slurm submits each run to Slurm, but it asks for 1 GPU per job "
        "(hydra.launcher.gpus_per_node=1) and no node of partition 'debug' has one (Gres=gpu); nothing was written: "
        "use hydra/launcher=slurm_cpu, or hydra.launcher.gpus_per_node=null, or a partition with GPUs")
    assert S.problem(S.launcher_settings("slurm", ["hydra.launcher.gpus_per_node=null"]), env) is None
    gpu_node = NODES.replace("Gres=(null)", "Gres=gpu:a100:4")
    assert S.problem(S.launcher_settings("slurm", []), fake_slurm(tmp_path / "g", nodes=gpu_node)) is None


def test_the_check_runs_only_for_a_sweep_through_slurm(tmp_path, monkeypatch):  # slurm-conf-missing
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "nonexistent.conf")}
    assert S.precheck(["-m", "hydra/launcher=slurm_cpu"], env) is not None
    assert S.precheck(["hydra/launcher=slurm_cpu", "hydra.mode=MULTIRUN"], env) is not None
    assert S.precheck(["-m", "+hydra/launcher=submitit_slurm"], env) is not None
    assert S.precheck(["hydra/launcher=slurm_cpu"], env) is None  # a single run runs here, whatever launcher
    assert S.precheck(["-m", "hydra/launcher=joblib_kvlab"], env) is None
    assert S.precheck(["-m", "hydra/launcher=slurm_cpu", "--cfg", "hydra"], env) is None  # prints, launches nothing
    assert S.slurm_launchers() >= {"slurm", "slurm_cpu", "submitit_slurm"}
    assert S.launcher_settings("slurm", ["hydra.launcher.partition=gpu"]) == dict(launcher="slurm", partition="gpu",
                                                                                  gpus_per_node=1)
    assert S.problem(S.launcher_settings("slurm_cpu", []), fake_slurm(tmp_path)) is None  # a cluster that answers


def test_the_check_from_a_composed_config_covers_a_launcher_chosen_anywhere(tmp_path):  # slurm-partition-unknown
    """composed_refusal: what a sweep callback (SweepReport.on_multirun_start) can call with Hydra's composed config."""
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        slurm = compose(config_name="config", overrides=["hydra/launcher=slurm_cpu", "hydra.launcher.partition=gpu"],
                        return_hydra_config=True)
        local = compose(config_name="config", return_hydra_config=True)
    env = fake_slurm(tmp_path)
    assert S.composed_refusal(slurm, env) == ("kvlab: hydra/launcher=slurm_cpu submits each run to Slurm, but the "
                                              "cluster has no partition 'gpu' (hydra.launcher.partition); nothing was "
                                              "written: give hydra.launcher.partition= one of debug, big")
    assert S.composed_refusal(local, {**env, "SLURM_CONF": "/nonexistent"}) is None  # not a Slurm launcher


# ---- run.py --------------------------------------------------------------------------------------------------------

def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (/proc/PID/status SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2],
                         ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_run_py_starts_is_one_line(tmp_path, signum):  # run-signal-while-starting
    """Sent as soon as run.py's start-up handler is in place (SIGTERM caught), while torch and Hydra still load."""
    folder = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "run.py", *TINY, "tracking=disabled", f"hydra.run.dir={folder}"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while p.poll() is None and not _catches(p.pid, signal.SIGTERM):
            time.sleep(0.002)
        p.send_signal(signum)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    name = signal.Signals(signum).name
    assert p.returncode == 128 + signum, err
    assert one_line(err) == f"kvlab: interrupted ({name}) while starting; nothing was written"
    assert out == "" and not folder.exists()


@pytest.mark.parametrize("argv, says", [
    (["--resolve"], "kvlab: --resolve goes with --cfg (or --help): it resolves the config that --cfg prints"),
    (["-m", "--cfg", "job"], "kvlab: --multirun and --cfg: give only one of --run, --multirun, --cfg, --info, "
                             "--shell-completion"),
    (["--bogus"], "kvlab: unrecognized arguments: --bogus"),
    (["--cfg"], "kvlab: argument --cfg/-c: expected one argument"),
])
def test_a_bad_flag_of_run_py_is_one_line(tmp_path, argv, says):  # run-bad-flags
    p = subprocess.run([sys.executable, "run.py", f"hydra.run.dir={tmp_path / 'run'}", *argv], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and one_line(p.stderr) == f"{says} (see python run.py --help)"
    assert not (tmp_path / "run").exists()


# ---- scripts -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_gpu_check_runs_from_a_python_without_torch(tmp_path):  # scripts-without-venv
    """`scripts/gpu-check --help` with the first python3 on PATH (the system's, which may lack torch) and no
    virtualenv active: it runs, with the repo's .venv if that python lacks torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    p = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: scripts/gpu-check")


def fake_repo(tmp_path, venv: str | None) -> Path:
    """A repo holding scripts/_venv.py and a script that needs the module ``kvlab_marker``; ``venv``: None (no
    .venv), "broken" (a .venv whose python lacks the module) or "good" (one whose python has it)."""
    scripts = tmp_path / "repo" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "_venv.py").write_text((REPO / "scripts" / "_venv.py").read_text())
    (scripts / "probe.py").write_text('import sys\nif __name__ == "__main__":\n    import _venv\n\n'
                                      '    _venv.ensure(__file__, ("kvlab_marker",))\n'
                                      'import kvlab_marker\nprint("ran", sys.argv[1:])\n')
    if venv:
        site = tmp_path / "site"
        site.mkdir()
        if venv == "good":
            (site / "kvlab_marker.py").write_text("")
        python = tmp_path / "repo" / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
        python.chmod(0o755)
    return scripts / "probe.py"


@pytest.mark.parametrize("venv", [None, "broken", "good"])
def test_a_script_without_its_packages_reruns_with_the_venv_or_says_make_setup(tmp_path, venv):  # scripts-without-venv
    probe = fake_repo(tmp_path, venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVLAB_SCRIPT_REEXEC")}
    p = subprocess.run([sys.executable, str(probe), "--x", "1"], env=env, capture_output=True, text=True, timeout=60)
    repo = probe.parent.parent
    if venv == "good":
        assert p.returncode == 0 and p.stdout == "ran ['--x', '1']\n", p.stderr
        return
    assert p.returncode == 2 and p.stdout == ""
    why = (f"the repo's virtualenv {repo / '.venv'} cannot import kvlab_marker (its install is unfinished or broken)"
           if venv else f"{sys.executable} cannot import kvlab_marker and there is no virtualenv at {repo / '.venv'}")
    assert one_line(p.stderr) == f"scripts/probe.py: {why}: run `make setup` in {repo}, then scripts/probe.py again"


def test_every_python_script_checks_its_python_first():  # scripts-without-venv
    for path in [*sorted((REPO / "scripts").glob("*.py")), REPO / "scripts" / "gpu-check"]:
        if path.name == "_venv.py":
            continue
        text = path.read_text()
        assert "_venv.ensure(__file__" in text, path
        assert text.index("_venv.ensure(__file__") < text.index("import torch") if "\nimport torch" in text else True


def test_remeasure_mini_without_a_python_is_one_line(tmp_path):  # remeasure-mini-no-python
    out = tmp_path / "out"
    script = str(REPO / "scripts" / "remeasure-mini")
    for env, argv, says in [
        ({"PY": str(tmp_path / "nonexistent")}, [str(out)],
         f"remeasure-mini: {tmp_path / 'nonexistent'} cannot run kvlab (missing, or without torch and hydra): run "
         "`make setup` first, or give PY=/path/to/python"),
        ({"ONLY": "kv_bits nosuch"}, [str(out)], "remeasure-mini: ONLY names 'nosuch', which is no sweep here: give "
                                                 "some of heads dtype kv_bits "),
        ({}, [str(out), "more"], "remeasure-mini: usage: scripts/remeasure-mini [OUT] (one folder; got 2 arguments)"),
        ({"MODELS": "mini gpt2"}, [str(out)], "remeasure-mini: MODELS names 'gpt2': give some of mini mini-llama"),
    ]:
        p = subprocess.run([script, *argv], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and one_line(p.stderr).startswith(says), p.stderr
        assert not out.exists()


def test_slurm_up_refuses_a_folder_it_cannot_make_before_anything_else(tmp_path):  # slurm-up-dir-unwritable
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    p = subprocess.run([str(REPO / "scripts" / "slurm-up"), str(a_file / "x")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert one_line(p.stderr) == (f"slurm-up: cannot make or write {a_file / 'x'} ({a_file} is not a writable "
                                  "folder): give another DIR")
    assert a_file.read_text() == "x"


def stub_commands(tmp_path, *names) -> tuple[dict, Path]:
    """An environment whose PATH first finds stand-ins for ``names``, each appending its name and arguments to
    the returned log and doing nothing else (a stand-in realpath prints a folder under tmp_path that does not exist,
    so that a script that got that far touches nothing of the machine's)."""
    bin_dir, log = tmp_path / "stubs", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in names:
        prints = f"echo {tmp_path / 'resolved'}\n" if name == "realpath" else ""
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{prints}')
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_remeasure_mini_help_is_its_usage_and_runs_nothing(tmp_path, flag):  # remeasure-mini-help
    env, log = stub_commands(tmp_path, "mkdir", "python")
    env["PY"] = str(tmp_path / "stubs" / "python")  # a sweep would call it: the log would say so
    p = subprocess.run([str(REPO / "scripts" / "remeasure-mini"), flag], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith("usage: scripts/remeasure-mini [-h] [OUT]\nThe sweeps and commands behind every "
                               "figure of the reference models")
    assert "OUT defaults to outputs/remeasure-mini" in p.stdout and " quanto4 quanto2 " in p.stdout
    assert not log.exists() and not (REPO / flag).exists() and not (tmp_path / flag).exists()


@pytest.mark.parametrize("argv", [["-x"], ["--out=x"], ["x", "--bogus"]])
def test_remeasure_mini_refuses_any_other_option_in_one_line(tmp_path, argv):  # remeasure-mini-help
    env, log = stub_commands(tmp_path, "mkdir", "python")
    env["PY"] = str(tmp_path / "stubs" / "python")
    p = subprocess.run([str(REPO / "scripts" / "remeasure-mini"), *argv], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    bad = next(a for a in argv if a.startswith("-"))
    assert p.returncode == 2 and p.stdout == ""
    assert one_line(p.stderr) == (f"remeasure-mini: no option {bad}: usage: scripts/remeasure-mini [OUT] (a folder; "
                                  f"one whose name starts with - as ./{bad}; see --help)")
    assert not log.exists() and not (REPO / bad).exists() and not (REPO / "x").exists()


def test_remeasure_mini_runs_each_of_its_names_and_the_heads_before_what_reads_them(tmp_path):
    """With a stand-in Python (it logs each call, and makes the sweep folder a run.py call names), the script reaches
    every name its --help lists, each once a model where it is a model's; the heads file is written before any run
    that reads it; the scorecards read every paper preset's folder; ONLY runs its names alone."""
    log, py = tmp_path / "calls.log", tmp_path / "python"
    py.write_text(f'#!/bin/sh\necho "$*" >> {log}\nfor a in "$@"; do case $a in hydra.sweep.dir=*) '
                  'mkdir -p "${a#hydra.sweep.dir=}";; esac; done\n')
    py.chmod(0o755)
    script = str(REPO / "scripts" / "remeasure-mini")
    names = subprocess.run([script, "--help"], capture_output=True, text=True).stdout.split("(for ONLY): ")[1].split()
    env = {**os.environ, "PY": str(py), "MODELS": "mini mini-llama"}
    p = subprocess.run([script, str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ran = [line.split(": ", 1)[0][3:] for line in p.stdout.splitlines() if line.startswith("== ")]
    assert sorted({r.rsplit("/", 1)[-1] for r in ran}) == sorted(names)
    assert len(ran) == len(set(ran))  # each once (per model)
    calls = log.read_text().splitlines()[1:]  # after the check that the Python runs kvlab
    for m in ("mini", "mini-llama"):
        heads = calls.index(f"-m harness.heads --model {m} --method streaming --out models/heads/{m}.csv")
        readers = [i for i, c in enumerate(calls) if f"models/heads/{m}.csv" in c or "experiment=paper_duo" in c
                   or "experiment=leaderboard" in c]
        assert heads == min(readers)
    scorecards = [c for c in calls if c.startswith("-m harness.scorecard ")]
    assert len(scorecards) == 2 and all(c.count("/paper_") == 8 for c in scorecards)
    log.unlink()
    p = subprocess.run([script, str(tmp_path / "only")], env={**env, "ONLY": "kv_stats duo25"}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and [line.split(": ", 1)[0] for line in p.stdout.splitlines() if line.startswith("== ")] \
        == ["== mini/duo25", "== mini/kv_stats", "== mini-llama/duo25", "== mini-llama/kv_stats"]


SLURM_STUBS = ("realpath", "mkdir", "hostname", "dpkg", "apt-get", "munged", "mariadbd", "slurmdbd", "slurmctld",
               "slurmd", "kill")


@pytest.mark.parametrize("script", ["slurm-up", "slurm-down"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_slurm_scripts_help_is_their_usage_and_does_nothing(tmp_path, script, flag):  # slurm-scripts-help
    env, log = stub_commands(tmp_path, *SLURM_STUBS)
    p = subprocess.run([str(REPO / "scripts" / script), flag], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    first, second = p.stdout.splitlines()[:2]
    assert first == f"usage: scripts/{script} [-h] DIR"
    assert second.startswith(("A real single-node Slurm", "Stops the single-node Slurm"))
    assert f"  scripts/{script} DIR" in p.stdout and "set -euo" not in p.stdout
    assert not log.exists(), log.read_text()  # nothing resolved, made, installed, started or stopped


@pytest.mark.parametrize("script", ["slurm-up", "slurm-down"])
@pytest.mark.parametrize("argv", [["--bogus"], ["-x", "dir"], ["dir", "--"]])
def test_slurm_scripts_refuse_any_other_option_in_one_line(tmp_path, script, argv):  # slurm-scripts-help
    env, log = stub_commands(tmp_path, *SLURM_STUBS)
    p = subprocess.run([str(REPO / "scripts" / script), *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    bad = next(a for a in argv if a.startswith("-"))
    assert p.returncode == 2 and p.stdout == ""
    assert one_line(p.stderr).startswith(f"{script}: no option {bad}: usage: scripts/{script} DIR (")
    assert not log.exists(), log.read_text()
    assert not (tmp_path / "dir").exists()


def test_slurm_scripts_pass_dir_to_realpath_after_double_dash(tmp_path):  # slurm-scripts-help
    """A DIR is an operand, never one of realpath's options: `realpath -m -- DIR`."""
    env, log = stub_commands(tmp_path, "realpath")
    p = subprocess.run([str(REPO / "scripts" / "slurm-down"), "some/dir"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and log.read_text() == "realpath -m -- some/dir\n", p.stderr
    assert one_line(p.stderr) == (f"slurm-down: {tmp_path / 'resolved' / 'run'} does not exist: nothing of "
                                  "slurm-up's runs there")
    for script in ("slurm-up", "slurm-down"):
        text = (REPO / "scripts" / script).read_text()
        assert 'realpath -m -- "$1"' in text and 'realpath -m "$1"' not in text


def _quanto_sweeps() -> dict[str, list[str]]:
    """remeasure-mini's quanto sweeps: name -> run.py's overrides, as the script passes them ($Q expanded)."""
    import shlex

    text = (REPO / "scripts" / "remeasure-mini").read_text()
    lines = [line.strip() for line in text.splitlines()]
    q = shlex.split(next(line for line in lines if line.startswith("Q=")).split("#")[0][2:])[0]
    sweeps = {}
    for line in lines:
        if line.startswith("sweep $M/quanto"):
            name, *args = shlex.split(line)[1:]
            sweeps[name.removeprefix("$M/")] = [q if a == "$Q" else a for a in args if a != "-m"]
    return sweeps


def test_remeasure_mini_quanto_sweeps_run_one_layout_on_both_engines():  # remeasure-mini-quanto-layout
    """Each quanto sweep composes and validates for both engines (engine=hf refuses cache=quant's per-channel K), and
    the two runs of a sweep differ by engine only: the same cache options."""
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import ConfigError, cache_options, register, validate

    from models.families import preset_config

    sweeps = _quanto_sweeps()
    assert set(sweeps) == {"quanto4", "quanto2"}
    mini = GPT2Config.preset("mini")
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for (name, overrides), model in ((s, m) for s in sweeps.items() for m in ("mini", "mini-llama")):
            assert "engine=kvlab,hf" in overrides and "model=$M" in overrides, name
            geometry = preset_config(model)
            runs = {}
            for engine in ("kvlab", "hf"):
                cfg = compose(config_name="config", overrides=[
                    f"engine={engine}" if o == "engine=kvlab,hf" else f"model={model}" if o == "model=$M" else o
                    for o in overrides])
                validate(cfg, geometry.n_positions, geometry.head_dim)  # ConfigError: the sweep would fail
                runs[engine] = cache_options(cfg.cache)
            assert runs["kvlab"] == runs["hf"] and runs["hf"]["k_axis"] == "token", (name, runs)
        assert runs["hf"]["k_bits"] == runs["hf"]["v_bits"] == 2  # quanto2
        old = compose(config_name="config", overrides=["model=mini", "engine=hf", "cache=quant"])
        with pytest.raises(ConfigError, match="cache.k_axis=token"):  # what the sweeps ran before
            validate(old, mini.n_positions, mini.head_dim)


def _measurements(*argv, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.measurements", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("where, says", [
    ("/proc/x", "--doc /proc/x: cannot write a file in /proc ("),
    ("{tmp}", "--doc {tmp}: that is a folder: give the file to write docs/results.md to"),
    ("{tmp}/missing/results.md", "--doc {tmp}/missing/results.md: folder {tmp}/missing does not exist"),
    ("/dev/null", "--doc /dev/null: not a regular file"),
    ("", "--doc '': that is a folder"),
])
def test_measurements_doc_to_a_place_it_cannot_write_is_one_line(tmp_path, where, says):  # measurements-doc-unwritable
    if where == "/proc/x" and not Path("/proc/self").is_dir():
        pytest.skip("needs /proc (Linux)")
    where, says = where.format(tmp=tmp_path), says.format(tmp=tmp_path)
    before = sorted(tmp_path.rglob("*"))
    p = _measurements(f"--doc={where}")
    assert p.returncode == 2 and p.stdout == ""
    assert one_line(p.stderr).startswith(f"python -m harness.measurements: error: {says}"), p.stderr
    assert sorted(tmp_path.rglob("*")) == before and not Path("/proc/x").exists()


def test_measurements_doc_is_written_atomically(tmp_path, monkeypatch, capsys):  # measurements-doc-unwritable
    from harness import measurements
    from harness.common import ownership
    from harness.measurements.__main__ import MARKER, main

    out, real, used = tmp_path / "results.md", ownership.atomic_write, []
    old = f"{MARKER} (an earlier --doc)\nold\n"  # a file --doc wrote: the only kind it replaces
    monkeypatch.setattr(ownership, "atomic_write", lambda path, write: (used.append(Path(path)), real(path, write)))
    out.write_text(old)
    assert main(["--doc", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == measurements.results_doc() and used == [out]

    def full_disk(path, write):  # atomic_write's temporary file could not be written: the old file stays
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ownership, "atomic_write", full_disk)
    out.write_text(old)
    assert main(["--doc", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == (f"python -m harness.measurements: error: --doc {out}: cannot write a "
                                                 f"file in {tmp_path} (No space left on device): give a file in a "
                                                 "folder you can write")
    assert out.read_text() == old and sorted(p.name for p in tmp_path.iterdir()) == ["results.md"]


def test_measurements_bad_flags_are_one_line(capsys):  # measurements-doc-unwritable
    from harness.measurements.__main__ import main

    assert main(["--keys", "--list"]) == 2
    assert one_line(capsys.readouterr().err) == ("python -m harness.measurements: error: argument --list: not allowed "
                                                 "with argument --keys (see python -m harness.measurements --help)")


@pytest.mark.parametrize("value", ["nan", "-1", "0", "1e308", "inf", "600.5", "abc"])
def test_wandb_report_timeout_is_refused_before_w_and_b(tmp_path, monkeypatch, capsys, value):  # wandb-report-timeout
    from harness.analysis import wandb_report as wrep

    def no_call(*a, **k):
        raise AssertionError("W&B was called")

    monkeypatch.setattr(wrep, "create", no_call)
    assert wrep.main(["quick-x", "--timeout", value, "--spec-only", str(tmp_path / "s.json")]) == 2
    assert one_line(capsys.readouterr().err) == (f"kvlab wandb_report: --timeout {value}: give the seconds each W&B "
                                                 "call may take, a number in (0, 600]")
    assert not list(tmp_path.iterdir())


def test_wandb_report_timeout_in_range_reaches_w_and_b(monkeypatch, capsys):  # wandb-report-timeout
    from harness.analysis import wandb_report as wrep

    seen = []
    monkeypatch.setattr(wrep, "create", lambda spec, timeout: seen.append(timeout) or "https://wandb.ai/r")
    for value in ("600", "0.5", "1e1"):
        assert wrep.main(["quick-x", "--entity", "e", "--timeout", value]) == 0
    assert seen == [600.0, 0.5, 10.0] and capsys.readouterr().out == "https://wandb.ai/r\n" * 3


@pytest.mark.parametrize("argv, says", [
    (["--entity", "a/b"], "--entity 'a/b': give a W&B entity name: 1 to 128 characters, none of / \\ # ? % : and no "
                          "spaces"),
    (["--project", ""], "--project '': give a W&B project name: 1 to 128 characters"),
    (["--project", "p" * 129], "--project 'ppp"),
    (["--project", "my project"], "--project 'my project': give a W&B project name"),
    (["--spec-only", ""], "--spec-only '': give a file (or a folder, for wandb_report.json in it)"),
    (["--bogus"], "unrecognized arguments: --bogus (see python -m harness.wandb_report --help)"),
    (["--timeout"], "argument --timeout: expected one argument (see python -m harness.wandb_report --help)"),
])
def test_wandb_report_other_flags_are_one_line(tmp_path, monkeypatch, capsys, argv, says):  # wandb-report-timeout
    from harness.analysis import wandb_report as wrep

    monkeypatch.setattr(wrep, "create", lambda *a, **k: pytest.fail("W&B was called"))
    monkeypatch.chdir(tmp_path)
    assert wrep.main(["quick-x", *argv]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"kvlab wandb_report: {says}")
    assert not list(tmp_path.iterdir())
