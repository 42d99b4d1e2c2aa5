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


def tiny_t5(seed: int = 0) -> nn.Module:
    """A T5 for conditional generation, 1 encoder and 1 decoder layer, width 32, 4 heads,
    dropout p=0; its loss is ``CrossEntropyLoss()`` of its logits against the labels."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.T5Config(
        vocab_size=SIZES["vocab_size"],
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T.T5ForConditionalGeneration(cfg)


def tiny_bert(head: str = "BertForMaskedLM", seed: int = 0, **kw: object) -> nn.Module:
    """A 1-layer BERT, hidden 32, 2 heads, every dropout p=0, with HF's ``head`` class
    (``BertForMaskedLM``, ``BertForTokenClassification``, ...); ``kw`` goes to the config
    (``num_labels=...``)."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **SIZES,
        **kw,
    )
    return getattr(T, head)(cfg)
