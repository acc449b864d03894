"""Is there a Slurm cluster to take a sweep? Checked by run.py before a sweep through submitit's Slurm launcher
(``-m hydra/launcher=slurm``, ``slurm_cpu`` or the plugin's own ``submitit_slurm``) writes anything: without it,
submitit fails deep in the sweep (``Could not detect "srun"``, ``sbatch: error: ... Unable to contact slurm
controller``) with some 40 lines of traceback, after the sweep folder already holds a manifest, Hydra's
``multirun.yaml`` and submitit's ``.submitit/``.

    why = problem(launcher_settings("slurm_cpu", overrides))   # None: the controller answers and can take the jobs
    line = precheck(sys.argv[1:])                               # run.py: the one-line refusal, or None
    line = composed_refusal(cfg)                                # the same from a composed config (a sweep callback)

What is checked, each bounded in time (``KVLAB_SLURM_TIMEOUT`` seconds, default 10, per command), in this order:
``SLURM_CONF``, when set, names a readable file (Slurm's own clients retry a missing one for 60 s); the client
commands submitit calls are on PATH (``sbatch``, ``srun``, ``sacct``, and ``scontrol`` to ask); ``scontrol ping``
says the controller is up; the partition asked for (``hydra.launcher.partition``) exists, or, none given, the cluster
has a default one; and a launcher that asks for GPUs (``gpus_per_node``) finds a node with a GPU in that partition.
Only the standard library is imported (and omegaconf, to read the launcher's yaml), so run.py checks before torch
loads.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = REPO / "conf" / "hydra" / "launcher"
PLUGIN_LAUNCHER = "submitit_slurm"  # hydra-submitit-launcher's own config: every kvlab Slurm launcher builds on it
COMMANDS = ("sbatch", "srun", "sacct", "scontrol")  # submitit: sbatch submits, srun is checked for at start and
# runs each job, sacct is polled for the jobs' states; scontrol answers here
TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 600.0
INFO_FLAGS = {"-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info", "-sc",
              "--shell-completion", "-p", "--package", "--resolve"}  # Hydra prints something and launches nothing


class SlurmUnreachable(Exception):
    """One line: what a sweep through Slurm lacks here."""


def timeout_s(env: dict | None = None) -> float:
    """``KVLAB_SLURM_TIMEOUT`` (seconds each Slurm command may take to answer): a number in (0, 600], default 10."""
    raw = (env if env is not None else os.environ).get("KVLAB_SLURM_TIMEOUT", "").strip()
    if not raw:
        return TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise SlurmUnreachable(f"KVLAB_SLURM_TIMEOUT={raw!r}: give the seconds a Slurm command may take to answer, "
                               f"a number in (0, {MAX_TIMEOUT_S:g}] (default {TIMEOUT_S:g})")
    return value


# ---- which launcher the command line picks -------------------------------------------------------------------------

def _override(arg: str) -> tuple[str, str] | None:
    """``key=value`` of one Hydra override (``+``, ``++`` prefixes dropped), or None."""
    m = re.fullmatch(r"\+{0,2}([\w./@-]+)=(.*)", arg, re.S)
    return (m.group(1), m.group(2).strip().strip("'\"")) if m else None


def is_multirun(argv: list[str]) -> bool:
    """Whether the command line asks for a sweep (``-m``, ``--multirun``, ``hydra.mode=MULTIRUN``): only a sweep goes
    through a launcher; a single run runs here whatever launcher is named."""
    if any(a in ("-m", "--multirun") for a in argv):
        return True
    return any((o := _override(a)) is not None and o[0] == "hydra.mode" and o[1].upper() == "MULTIRUN" for a in argv)


def chosen_launcher(argv: list[str]) -> str | None:
    """The ``hydra/launcher`` option the command line picks (the last one, as Hydra takes it); None: none given."""
    pick = None
    for a in argv:
        o = _override(a)
        if o is not None and o[0] == "hydra/launcher":
            pick = o[1]
    return pick


def slurm_launchers() -> set[str]:
    """The launcher options that submit to Slurm: submitit's own and every kvlab yaml built on it."""
    names = {PLUGIN_LAUNCHER}
    for f in LAUNCHERS.glob("*.yaml"):
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if re.search(rf"^\s*-\s*{PLUGIN_LAUNCHER}\s*$", text, re.M):
            names.add(f.stem)
    return names


def _value(text: str):
    """An override's value as Hydra reads the two settings checked here: null, an integer, or a string."""
    if text.lower() in ("null", "none", "~", ""):
        return None
    try:
        return int(text)
    except ValueError:
        return text


def launcher_settings(launcher: str, argv: list[str]) -> dict:
    """``partition`` and ``gpus_per_node`` as the sweep will submit them: the launcher's yaml, then the command
    line's ``hydra.launcher.partition=`` / ``hydra.launcher.gpus_per_node=`` (the last one given)."""
    settings: dict = {"launcher": launcher, "partition": None, "gpus_per_node": None}
    path = LAUNCHERS / f"{launcher}.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        try:
            cfg = OmegaConf.to_container(OmegaConf.load(path))
        except Exception:  # a yaml Hydra will refuse itself, in its own words
            cfg = {}
        for key in ("partition", "gpus_per_node"):
            if isinstance(cfg, dict) and key in cfg:
                settings[key] = cfg[key]
    for a in argv:
        o = _override(a)
        if o is not None and o[0] in ("hydra.launcher.partition", "hydra.launcher.gpus_per_node"):
            settings[o[0].rsplit(".", 1)[1]] = _value(o[1])
    return settings


# ---- asking Slurm ----------------------------------------------------------------------------------------------------

def _gist(out: subprocess.CompletedProcess) -> str:
    """The line of a failed Slurm command that says why: a fatal/error line or the DOWN line, short."""
    lines = [ln.strip() for ln in (out.stderr or "").splitlines() + (out.stdout or "").splitlines()]
    lines = [ln for ln in lines if ln and not set(ln) <= {"*"} and "RESTORE SLURMCTLD" not in ln]
    pick = next((ln for ln in lines if "fatal" in ln), None) or next((ln for ln in lines if "DOWN" in ln), None)
    pick = pick or next((ln for ln in lines if "error" in ln), None)
    pick = pick or (lines[0] if lines else f"exit {out.returncode}")
    return pick if len(pick) <= 160 else pick[:157] + "..."


def _ask(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        raise SlurmUnreachable(f"the Slurm controller did not answer `{' '.join(cmd)}` within {timeout:g} s "
                               "(KVLAB_SLURM_TIMEOUT)") from None
    except OSError as e:
        raise SlurmUnreachable(f"`{cmd[0]}` could not be run ({e.strerror or e})") from None


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


CLUSTER_TODO = ("start a one-node cluster with `scripts/slurm-up DIR` and export the SLURM_CONF=... it prints, point "
                "SLURM_CONF at your cluster's slurm.conf (with sbatch, srun, sacct and scontrol on PATH), or leave out "
                "hydra/launcher={launcher} to run the sweep on this machine")


def problem(settings: dict | None = None, env: dict | None = None) -> str | None:
    """What a sweep through Slurm lacks here, in words (None: the controller answers and can take the jobs).
    ``settings``: ``launcher_settings``' partition and gpus_per_node (None: only the cluster is checked)."""
    found = diagnose(settings, env)
    return None if found is None else found[0]


def diagnose(settings: dict | None = None, env: dict | None = None) -> tuple[str, str] | None:
    """(what a sweep through Slurm lacks here, what to do about it), or None when Slurm can take it."""
    env = dict(os.environ if env is None else env)
    settings = settings or {}
    launcher = settings.get("launcher") or PLUGIN_LAUNCHER
    try:
        return _diagnose(settings, env, launcher)
    except SlurmUnreachable as e:
        if str(e).startswith("KVLAB_SLURM_TIMEOUT="):
            return str(e), "unset it for the default, or give such a number"
        return str(e), CLUSTER_TODO.format(launcher=launcher)


def _diagnose(settings: dict, env: dict, launcher: str) -> tuple[str, str] | None:
    timeout = timeout_s(env)
    cluster = CLUSTER_TODO.format(launcher=launcher)
    conf = env.get("SLURM_CONF")
    if conf is not None:
        path = Path(conf)
        if not conf.strip():
            return "SLURM_CONF is set but empty", cluster
        if path.is_dir():
            return f"SLURM_CONF={conf} is a folder, not a slurm.conf", cluster
        if not path.is_file():
            return f"SLURM_CONF={conf} does not exist", cluster
        if not os.access(path, os.R_OK):
            return f"SLURM_CONF={conf} cannot be read", cluster
    missing = [c for c in COMMANDS if shutil.which(c, path=env.get("PATH", os.defpath)) is None]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH (Slurm's client commands)", \
            cluster
    ping = _ask(["scontrol", "ping"], timeout, env)
    if ping.returncode != 0:
        return f"the Slurm controller does not answer (`scontrol ping`: {_gist(ping)})", cluster
    partition, gpus = settings.get("partition"), settings.get("gpus_per_node")
    parts = _ask(["scontrol", "show", "partition", "-o"], timeout, env)
    if parts.returncode != 0:
        return f"the Slurm controller does not list its partitions (`scontrol show partition`: {_gist(parts)})", \
            cluster
    table = [_fields(ln) for ln in parts.stdout.splitlines() if ln.startswith("PartitionName=")]
    names = [p.get("PartitionName", "") for p in table]
    if partition is not None and str(partition) not in names:
        return (f"the cluster has no partition {partition!r} (hydra.launcher.partition)",
                f"give hydra.launcher.partition= one of {', '.join(names) or '(none listed)'}")
    if partition is None:
        default = [p.get("PartitionName", "") for p in table if p.get("Default") == "YES"]
        if not default:
            return ("no partition is given and the cluster has no default one",
                    f"give hydra.launcher.partition= one of {', '.join(names) or '(none listed)'}")
        partition = default[0]
    if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 0:
        nodes = _ask(["scontrol", "show", "node", "-o"], timeout, env)
        with_gpu = [n for n in (_fields(ln) for ln in nodes.stdout.splitlines())
                    if str(partition) in n.get("Partitions", "").split(",") and "gpu" in n.get("Gres", "")]
        if nodes.returncode == 0 and not with_gpu:
            return (f"it asks for {gpus} GPU per job (hydra.launcher.gpus_per_node={gpus}) and no node of partition "
                    f"{partition!r} has one (Gres=gpu)",
                    "use hydra/launcher=slurm_cpu, or hydra.launcher.gpus_per_node=null, or a partition with GPUs")
    return None


def precheck(argv: list[str], env: dict | None = None) -> str | None:
    """run.py's check: for a sweep through a Slurm launcher, the one line that refuses it when Slurm cannot take
    it (None: no Slurm launcher, not a sweep, Hydra only prints something, or Slurm answers)."""
    launcher = chosen_launcher(argv)
    if launcher is None or launcher not in slurm_launchers() or not is_multirun(argv):
        return None
    if any(a in INFO_FLAGS or a.split("=", 1)[0] in INFO_FLAGS for a in argv):
        return None
    env = dict(os.environ if env is None else env)
    settings = launcher_settings(launcher, argv)
    return _refusal(launcher, diagnose(settings, env))


def _refusal(launcher: str, found: tuple[str, str] | None) -> str | None:
    if found is None:
        return None
    why, todo = found
    return f"kvlab: hydra/launcher={launcher} submits each run to Slurm, but {why}; nothing was written: {todo}"


def composed_refusal(config, env: dict | None = None) -> str | None:
    """The same check from a composed Hydra config (what a callback's ``on_multirun_start`` is handed): it covers a
    Slurm launcher chosen anywhere (a preset, a config of your own), not only on the command line. None: the
    launcher is not submitit's Slurm launcher, or Slurm can take the sweep."""
    hydra_cfg = config.hydra
    launcher_cfg = hydra_cfg.launcher
    if not str(launcher_cfg.get("_target_", "")).endswith(".SlurmLauncher"):
        return None
    launcher = str(hydra_cfg.runtime.choices.get("hydra/launcher") or PLUGIN_LAUNCHER)
    settings = {"launcher": launcher, "partition": launcher_cfg.get("partition"),
                "gpus_per_node": launcher_cfg.get("gpus_per_node")}
    return _refusal(launcher, diagnose(settings, env))
