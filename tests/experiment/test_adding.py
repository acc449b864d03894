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
    path = tmp_path / "mirror_kind.py"
    path.write_text(textwrap.dedent(KIND))
    spec = importlib.util.spec_from_file_location("mirror_kind", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mirror_kind"] = module
    try:
        spec.loader.exec_module(module)
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
