"""Shared fixtures. Nothing here touches the network: the hub is offline and W&B writes to temporary folders."""

import os
import tempfile

_TMP = tempfile.mkdtemp(prefix="kvlab-tests-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
    os.environ[var] = os.path.join(_TMP, var.lower())
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.pop("WANDB_API_KEY", None)
os.environ["WANDB_SILENT"] = "true"

import pytest  # noqa: E402
import torch  # noqa: E402

from models.gpt2 import GPT2, GPT2Config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config.preset("tiny")).eval()
