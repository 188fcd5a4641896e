"""A tiny HF model folder (config.json only): vLLM's ModelConfig needs no weights."""

from __future__ import annotations

import json
import os
from pathlib import Path


def make_model_dir(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 16,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    dtype: str = "float16",
) -> str:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": num_heads * head_size,
        "intermediate_size": 4 * num_heads * head_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_size,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (p / "config.json").write_text(json.dumps(cfg))
    return str(p)
