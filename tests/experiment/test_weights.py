"""``model.weights=auto``: the real checkpoint when the hub (here a stand-in on 127.0.0.1) gives it, the seeded init
with one printed line when it cannot, within a bounded wait; the local HF cache without asking anyone."""

import json
import os
import subprocess
import sys

import pytest
import torch

from models.gpt2 import GPT2
from tests.helpers import REPO, run_py
from tests.helpers.fake_hub import Blackhole, FakeHub, closed_port_url

RESOLVE = """
import json, sys
from types import SimpleNamespace
from harness.experiment.weights import resolve
w = resolve(SimpleNamespace(preset=sys.argv[1], weights='auto', seed=0))
print(json.dumps(dict(kind=w.kind, source=w.source, load_from=w.load_from, detail=w.detail)))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny HF GPT-2 checkpoint written here (nothing is downloaded)."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    GPT2LMHeadModel(HFConfig(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=100, bos_token_id=0,
                             eos_token_id=0)).save_pretrained(folder)
    return folder


def resolve_in_subprocess(tmp_path, endpoint: str, preset: str = "gpt2", offline: bool = False):
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), KVLAB_HUB_TIMEOUT="1",
               HF_HUB_OFFLINE="1" if offline else "0")
    # a hang (an unbounded wait for the hub) ends in TimeoutExpired: the guard is the timeout, no time is asserted
    proc = subprocess.run([sys.executable, "-c", RESOLVE, preset], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_auto_downloads_through_the_hub_and_loads_the_same_logits(tmp_path, checkpoint):
    hub = FakeHub(checkpoint)
    try:
        w, err = resolve_in_subprocess(tmp_path, hub.url)
        asked = list(hub.requests)
        # a second process finds it in the local HF cache, without asking the hub, even offline
        again, _ = resolve_in_subprocess(tmp_path, hub.url, offline=True)
    finally:
        hub.close()
    assert w["kind"] == "pretrained" and w["source"] == "openai-community/gpt2", (w, err)
    assert any(r.startswith("GET /openai-community/gpt2/resolve/") for r in asked)
    assert len(hub.requests) == len(asked)  # the second resolve sent nothing
    assert again["kind"] == "pretrained" and again["load_from"] == w["load_from"]
    assert "local HF cache" in again["detail"]
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        via_hub = GPT2.from_pretrained(w["load_from"])(ids)
        direct = GPT2.from_pretrained(checkpoint)(ids)
    assert torch.equal(via_hub, direct)


@pytest.mark.slow  # a run or a trained model's drift: tens of seconds
def test_a_run_with_auto_weights_records_the_hub_checkpoint(tmp_path, checkpoint):
    hub = FakeHub(checkpoint)
    try:
        out = tmp_path / "run"
        run_py(["model=gpt2", "prompts=random", "n_prompts=1", "new_tokens=4", "prompt_len=4", "repeats=1",
                       "warmup=0", "context_lengths=[8]", "dtype=fp16", "measurements=[equivalence]",
                       "tracking=disabled", f"hydra.run.dir={out}"],
                      tmp_path, dict(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"),
                                     KVLAB_HUB_TIMEOUT="2"))
    finally:
        hub.close()
    r = json.loads((out / "results.json").read_text())
    assert r["status"] == "ok", r["error"]
    assert (r["weights"], r["weights_source"], r["weights_requested"]) == ("pretrained", "openai-community/gpt2",
                                                                          "auto")
    assert r["n_layer"] == 2 and r["n_embd"] == 32  # the checkpoint's geometry, not the gpt2 preset's


@pytest.mark.parametrize("where", ["closed-port", "no-answer", "dns-failure"])
def test_an_unreachable_hub_falls_back_to_random_in_seconds(tmp_path, where):
    hole = Blackhole() if where == "no-answer" else None
    url = {"closed-port": closed_port_url, "no-answer": lambda: hole.url,
           "dns-failure": lambda: "http://kvlab-no-such-host.invalid"}[where]()
    try:
        w, err = resolve_in_subprocess(tmp_path, url)
    finally:
        if hole:
            hole.close()
    assert w["kind"] == "random" and w["source"] == "random" and w["load_from"] is None
    lines = [ln for ln in err.splitlines() if "model.weights=auto" in ln]
    assert len(lines) == 1 and "openai-community/gpt2" in lines[0] and "random init" in lines[0]


def test_offline_never_asks_the_hub(tmp_path, checkpoint):
    hub = FakeHub(checkpoint)
    try:
        w, err = resolve_in_subprocess(tmp_path, hub.url, offline=True)
    finally:
        hub.close()
    assert hub.requests == [] and w["kind"] == "random" and "HF_HUB_OFFLINE is set" in err


def test_a_preset_without_a_published_checkpoint_is_random_without_asking(tmp_path, checkpoint):
    hub = FakeHub(checkpoint)
    try:
        w, _ = resolve_in_subprocess(tmp_path, hub.url, preset="tiny")
    finally:
        hub.close()
    assert hub.requests == [] and w["kind"] == "random" and "no published checkpoint" in w["detail"]
