"""A run's record (results.json) outside its measurements: who it is, what it was asked, what that resolved to, and
what it ran on. Each part is a frozen dataclass whose fields are exactly its keys, each with a meaning and a unit,
as a measurement's ``Result`` is; results.json = these parts + the Results of the measurements that ran.

    python -m harness.measurements --keys     # every key a run can write, these included
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.measurements.base import key

PART = "run"  # what --keys names as the "measurement" of these keys


@dataclass(frozen=True)
class Identity:
    run_name: str = key("the run folder's name")
    group: str = key("the W&B group: the sweep folder's name (or the run's)")
    run_dir: str = key("the run's folder")
    config_id: str = key("12 hex digits naming what the run measures (its config without tracking/resume)")
    invocation: str = key("the kvlab invocation that made (or last confirmed) this record")
    invocations: str = key("every kvlab invocation that made or confirmed this record, space-separated (a sweep's "
                           "report counts the runs whose record names its invocation here)")
    status: str = key("ok | failed | interrupted | not_equivalent")
    error: str | None = key("why it is not ok, one line")
    failed_stage: str | None = key("the measurement a failed run was in")
    signal: str | None = key("the signal that interrupted it")
    started_at: str = key("when it started (local time, ISO 8601)")
    finished_at: str | None = key("when it ended")
    duration_s: float | None = key("how long it took", "s")
    wandb: str | None = key("where its W&B run is (offline folder, URL, disabled, or failed: why)")
    wandb_id: str | None = key("its W&B run id (the same when resumed in the same folder)")
    measurements: str = key("the measurements the run was asked for, comma-separated")
    concurrent_runs_while_timing: int | None = key("other kvlab runs measuring on this machine meanwhile", "runs")
    slurm_job_id: str | None = key("the Slurm job that ran it (<array job>_<task> for an array task; null: not in "
                                   "Slurm)")
    slurm_array_task_id: int | None = key("its index in the sweep's job array (null: not an array task)")


@dataclass(frozen=True)
class Setting:
    model: str = key("the model's label")
    preset: str | None = key("the GPT2Config preset of random or auto weights")
    model_seed: int = key("seed of the random init")
    outlier_scale: float | None = key("model.outliers.scale: the factor one K and one V channel per head were "
                                      "given, the model's function kept (1: the weights as loaded, nothing injected)")
    engine: str = key("kvlab | hf | llamacpp")
    cache: str = key("the cache kind")
    cache_target: str | None = key("the class of a kind from outside kvlab, package.module:ClassName (cache=external's "
                                   "cache.target, or an installed package's kvlab.cache_kinds entry point); null: "
                                   "one of kvlab's own kinds")
    cache_label: str = key("kind + options (+ · engine when not kvlab): how runs are told apart")
    cache_exact: bool | None = key("the kind is exact (must equal its reference): on llama.cpp, only in the "
                                   "storage dtype's K/V types")
    cache_full_attention: bool | None = key("the kind, with this run's options, keeps every position: exactly full "
                                            "attention (the reference drift is measured against)")
    cache_implied: str | None = key("the kind's options (comma-separated) whose value its others imply: set from them "
                                    "(a window's window, budget - sinks) or the default")
    engine_type_k: str | None = key("the K type llama.cpp stores (engine=llamacpp: f32, f16, q8_0, q4_0, ...; "
                                    "cache=quant's as llama.cpp's); null on the other engines")
    engine_type_v: str | None = key("the V type llama.cpp stores, the same way")
    engine_threads: int | None = key("the threads llama.cpp computes with (engine.threads, or torch's count where "
                                     "that is 0); null on the engines that compute in torch (their count is "
                                     "threads)", "threads")
    dtype: str = key("the dtype label: storage, or storage/compute")
    device_requested: str = key("cpu | cuda | auto, as asked")
    experiment: str = key("the experiment preset")
    n_prompts: int = key("prompts generated from", "prompts")
    new_tokens: int = key("tokens generated per prompt", "tokens")
    prompt_len: int = key("tokens per prompt", "tokens")
    max_len: int | None = key("cache capacity (resolved: the model's n_positions when not set)", "tokens")
    batch: int = key("sequences in the served batch", "sequences")
    compile: bool = key("the decode step is torch.compiled")
    prompt_lengths: str = key("uniform | ragged")
    context_lengths: str | None = key("the timed contexts, comma-separated (resolved)", "tokens")
    repeats: int = key("timed repeats per measurement", "repeats")
    warmup: int = key("untimed warm-up repeats", "repeats")
    seed: int = key("seed of the prompts and timing inputs")
    prompts: str = key("file | random")


@dataclass(frozen=True)
class Weights:
    weights: str | None = key("random | pretrained")
    weights_source: str = key("random, the hub id or the checkpoint folder")
    weights_detail: str = key("one line for people")
    weights_requested: str = key("model.weights as asked")
    inputs_prompts: str | None = key("hash of the prompts file (a changed file is measured again)")
    inputs_checkpoint: str | None = key("hash of every checkpoint file a run reads (config.json, the weights or their "
                                         "shards and index, tokenizer.json)")
    inputs_trace: str | None = key("hash of the serving trace (serve.trace; null: none read)")
    inputs_cache: str | None = key("hash of the files the cache kind reads (cache=duo's cache.heads; null: none)")
    inputs_code: str | None = key("hash of kvlab's code and configs (and of the module file of a kind from outside "
                                  "kvlab: cache_target)")


@dataclass(frozen=True)
class Resolved:
    device: str = key("the device used: cpu | cuda")
    storage_dtype: str = key("dtype of K and V in the cache")
    compute_dtype: str = key("dtype of the model")
    n_layer: int = key("layers", "layers")
    n_head: int = key("query heads per layer", "heads")
    n_kv_head: int = key("K/V heads per layer, what the cache stores (n_head: multi-head; fewer: grouped-query; 1: "
                         "multi-query)", "heads")
    model_family: str = key("the decoder family: gpt2, llama, qwen2 or mistral (config.json's model_type)")
    n_embd: int = key("model width", "channels")
    n_params: int = key("parameters (the tied output embedding once)", "parameters")
    outlier_k_channels: str | None = key("the K channel made an outlier in each layer and head, as "
                                         "model.outliers.k_channels takes it ([[layer 0's per head], ...]); null: "
                                         "none (outlier_scale 1)")
    outlier_v_channels: str | None = key("the V channel made an outlier in each layer and head, as "
                                         "model.outliers.v_channels takes it; null: none (outlier_scale 1)")
    prompt_tokenizer: str | None = key("what made the text prompts: gpt2 (GPT-2's tokenizer), or the checkpoint's "
                                       "tokenizer.json; null: random token ids (prompts=random)")
    engine_rotation: str | None = key("which of K and V llama.cpp rotated by its Hadamard matrix before storing "
                                      "them quantised (kv, k, v or none: cache.rotate under cache=quant, "
                                      "else engine.rotate; auto is llama.cpp's default); null on kvlab's and HF's "
                                      "engines (kvlab's own rotation is cache_rotate)")
    first_token: int | None = key("the token every prompt, text and retrieval sequence of the run starts with: the "
                                  "checkpoint was trained with it at position 0 (config.json's kvlab_bos), so "
                                  "cache.sinks=1 keeps exactly it; null: none", "token id")
    first_token_share: float | None = key("the most attention one head puts on the first token (queries at positions "
                                          ">= 64 of held-out text), as the checkpoint's training evaluation measured "
                                          "it (config.json kvlab_train.targets.sink_head_max): whether the first "
                                          "token is a sink; null: not measured", "fraction")


@dataclass(frozen=True)
class Fingerprint:
    torch_version: str = key("torch.__version__")
    device_name: str = key("the CPU model or GPU name")
    cpu_count: int | None = key("os.cpu_count()", "cores")
    threads: int = key("torch's intra-op threads", "threads")
    attn_backend: str = key("the attention backend")
    tf32: bool = key("TF32 matmuls allowed (CUDA)")
    git_commit: str = key("kvlab's commit (-dirty: with uncommitted changes)")
    python_version: str = key("Python's version")
    cpu_kernels: str = key("the path a decode step's projections and dense attention ran: kvlab's kernels for this CPU "
                           "(avx512, avx2, portable) or torch (KVLAB_KERNELS=torch, a GPU, no C++ compiler); "
                           "models.cpu_kernels")


PARTS = (Identity, Setting, Weights, Resolved, Fingerprint)
CACHE_OPTION = "cache_<option>"  # one key per option of the run's cache kind


def typed(cls, values: dict) -> dict:
    """``values`` checked against a part (every key, nothing else: TypeError otherwise), as a plain dict."""
    return dataclasses.asdict(cls(**values))


def cache_option_keys() -> dict[str, str]:
    """``cache_<option>`` -> the kinds that have that option."""
    from models.kv_cache import CACHE_KINDS

    out: dict[str, list[str]] = {}
    for name, cls in CACHE_KINDS.items():
        for opt in cls.option_types():
            out.setdefault(f"cache_{opt}", []).append(name)
    return {k: ", ".join(v) for k, v in out.items()}
