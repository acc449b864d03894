"""Adding a cache kind is one module (its class, registered) and, if it wants one, its YAML: a throwaway kind
registered in a temporary module runs through a real run, its config composed from the registry alone. (A
measurement: tests/measurements/test_measurements.py's test_adding_a_measurement_is_one_module and its hooks test.)"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from harness.experiment import runner
from harness.experiment.config import register
from models.kv_cache import CACHE_KINDS
from tests.helpers import REPO

def _module(folder, name: str, source: str):
    """``source`` written to ``folder/name.py`` and imported as module ``name`` (a temporary module of the test's)."""
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


KIND = '''
from dataclasses import dataclass

from models.kv_cache import register
from models.kv_cache.prealloc import PreallocKVCache


@dataclass(frozen=True)
class MirrorOptions:
    spare: int = 0  # slots held past max_len (a toy option, typed by its default)


@register
class MirrorKVCache(PreallocKVCache):
    """Prealloc's layout under another name: an exact kind of its own."""
    kind, Options = "mirror", MirrorOptions
    description = "a throwaway kind: prealloc's layout"
    examples = ({"spare": 0},)
'''


def test_a_new_kind_is_one_module_and_runs_through_a_real_run(tmp_path, monkeypatch):
    try:
        _module(tmp_path, "mirror_kind", KIND)
        assert "mirror" in CACHE_KINDS and not (REPO / "conf" / "cache" / "mirror.yaml").exists()
        register()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose(config_name="config", overrides=[
                "model=tiny", "cache=mirror", "cache.spare=0", "n_prompts=2", "new_tokens=4", "prompt_len=4",
                "repeats=1", "warmup=0", "context_lengths=[8]", "measurements=[equivalence,memory]",
                "tracking.mode=disabled"])
        out = tmp_path / "run"
        monkeypatch.setattr(runner, "_hydra_dirs", lambda: (out, "t", "run"))
        rec = runner.run(cfg, progress=False)
        assert rec["status"] == "ok", rec.get("error")
        assert rec["cache"] == "mirror" and rec["cache_exact"] is True and rec["tokens_identical"] is True
        assert rec["cache_full_attention"] is True and rec["nbytes_match"] is True
        assert (out / "results.json").is_file()
    finally:
        CACHE_KINDS.pop("mirror", None)
        sys.modules.pop("mirror_kind", None)
        repo = ConfigStore.instance().repo  # the nodes register() stored for it
        for group in (repo.get("cache", {}), repo.get("schema", {}).get("cache", {})):
            group.pop("mirror.yaml", None)


FAMILY = '''
from dataclasses import dataclass

from models.gpt2 import GPT2, GPT2Config

PRESETS = {"toy-mirror": dict(n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=512)}


@dataclass
class MirrorConfig(GPT2Config):
    """GPT-2's geometry under a family of its own (a throwaway)."""

    family = "mirror"

    @classmethod
    def preset(cls, name):
        return cls(**PRESETS[name])


class Mirror(GPT2):
    """GPT-2's decoder under a family of its own."""
'''


def test_a_new_family_is_one_module_and_a_line_and_runs_through_a_real_run(tmp_path, monkeypatch):
    """A family's module (its config and decoder) and its line in models/families.py: a run on its preset's random
    init is measured like any other (the harness asks the config, never the family's name)."""
    from models import families
    from models.gpt2 import GPT2

    try:
        module = _module(tmp_path, "mirror_family", FAMILY)
        assert families.model_class(module.MirrorConfig.preset("toy-mirror")) is GPT2  # not yet a family
        # the family's line in models/families.py
        monkeypatch.setitem(families.CONFIG_CLASSES, module.Mirror, module.MirrorConfig)
        monkeypatch.setitem(families.PRESETS, "toy-mirror", module.MirrorConfig)
        register()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose(config_name="config", overrides=[
                "model=tiny", "model.preset=toy-mirror", "model.name=toy-mirror", "model.weights=random",
                "cache=prealloc", "n_prompts=2", "new_tokens=4", "prompt_len=4", "repeats=1", "warmup=0",
                "context_lengths=[8]", "measurements=[equivalence,memory]", "tracking.mode=disabled",
                "prompts=random"])
        out = tmp_path / "run"
        monkeypatch.setattr(runner, "_hydra_dirs", lambda: (out, "t", "run"))
        rec = runner.run(cfg, progress=False)
        assert rec["status"] == "ok", rec.get("error")
        assert rec["model"] == "toy-mirror" and rec["model_family"] == "mirror"
        assert (rec["n_layer"], rec["n_embd"]) == (2, 32)
        assert families.model_class(module.MirrorConfig.preset("toy-mirror")) is module.Mirror
        assert rec["tokens_identical"] is True and rec["nbytes_match"] is True
    finally:
        sys.modules.pop("mirror_family", None)
