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


_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": SIZES["vocab_size"],
    "max_position_embeddings": SIZES["max_position_embeddings"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# name -> (config class, model class, config overrides): tiny, every dropout 0 (the default
# of each of these configs, or set here), so one process and the ranks draw nothing.
TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}


def tiny_hf(name: str, seed: int = 0, **sizes: int) -> nn.Module:
    """A tiny ``transformers`` model by family name: the ``TINY`` decoders (2 layers, hidden
    64, 4 query and 2 key/value heads, vocabulary 128), ``t5`` (``tiny_t5``) or ``vit`` (a
    1-layer ViT image classifier on 8x8 images, 3 labels); ``sizes`` override a decoder's
    config (``hidden_size=48, num_attention_heads=6, ...`` for 3 ranks)."""
    import transformers as T

    if name == "t5":
        return tiny_t5(seed)
    torch.manual_seed(seed)
    if name == "vit":
        cfg = T.ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=8,
            patch_size=4,
            num_labels=3,
        )
        return T.ViTForImageClassification(cfg)
    cfg_cls, model_cls, extra = TINY[name]
    kw = {k: v for k, v in {**_DECODER, **extra, **sizes}.items() if v is not None}
    return getattr(T, model_cls)(getattr(T, cfg_cls)(**kw))


def tiny_batches(name: str, steps: int, rows: int = 4, seq: int = 8) -> list[dict]:
    """``steps`` HF batches for ``tiny_hf(name)`` (seeded): token rows with labels, T5's
    inputs and labels (no padding), ViT's images and class labels."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if name == "vit":
            out.append(
                {
                    "pixel_values": torch.randn(rows, 3, 8, 8, generator=g),
                    "labels": torch.randint(0, 3, (rows,), generator=g),
                }
            )
            continue
        ids = torch.randint(3, SIZES["vocab_size"], (rows, seq), generator=g)
        labels = torch.randint(3, SIZES["vocab_size"], (rows, seq), generator=g)
        out.append({"input_ids": ids, "labels": labels if name == "t5" else ids})
    return out


def plain_sgd(model: nn.Module, batches: list[dict], lr: float) -> tuple[list[float], dict]:
    """One plain HF process under SGD, the reference the distributed runs are held to: every
    step's loss (the model's own) and the final weights."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
