"""kvlab's decoders (``gpt2``, ``llama``: Llama, Qwen2, Mistral), their KV caches (``kv_cache``) and generation."""


def load_model(path_or_id):
    """A checkpoint folder of any family kvlab computes, as kvlab's model (``models.families.load_model``)."""
    from models.families import load_model as load

    return load(path_or_id)
