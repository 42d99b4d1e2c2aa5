"""Tiny Hugging Face ``transformers`` models built from config objects (random init, nothing
downloaded), shared by the tests that run real HF code. ``transformers`` is in the ``dev``
extra, so these tests run wherever the suite runs."""

from __future__ import annotations

import torch
from torch import nn

SIZES = {"vocab_size": 128, "max_position_embeddings": 64}


def tiny_llama(seed: int = 0) -> nn.Module:
    """A 2-layer Llama, hidden 64, 4 query and 2 key/value heads."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **SIZES,
    )
    return T.LlamaForCausalLM(cfg)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2, width 64, 4 heads, every dropout p=0 (the identity, no draw)."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.GPT2Config(
        vocab_size=SIZES["vocab_size"],
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=SIZES["max_position_embeddings"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return T.GPT2LMHeadModel(cfg)
