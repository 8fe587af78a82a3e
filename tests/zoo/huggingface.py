"""Hugging Face transformers models, built from small configs, fed padded batches as a data collator gives them.

Every case gets right-padded ``input_ids``, an ``attention_mask`` with zeros on the padding and, where the model
computes its own loss, labels of -100 there. Dropout is off, so eager and ONNX Runtime see the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.zoo.features import Case, Inputs

transformers = __import__("pytest").importorskip("transformers")

VOCAB, BATCH, LENGTH = 96, 3, 12
LENGTHS = (LENGTH, 9, 5)
"""Tokens per row before padding: the first row is full, the others are padded."""

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def padded_batch(g: torch.Generator, labels: str | None = "tokens") -> Inputs:
    """Right-padded token ids, their attention mask and labels (-100 on padding, or one class per row)."""
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)
    mask = (torch.arange(LENGTH) < torch.tensor(LENGTHS).unsqueeze(1)).long()
    kwargs: dict[str, Any] = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    if labels == "tokens":
        kwargs["labels"] = ids.masked_fill(mask == 0, -100)
    elif labels == "classes":
        kwargs["labels"] = torch.randint(0, 3, (BATCH,), generator=g)
    return (), kwargs


def seq2seq_batch(g: torch.Generator) -> Inputs:
    _, kwargs = padded_batch(g)
    decoder = torch.randint(3, VOCAB, (BATCH, 7), generator=g)
    return (), {**kwargs, "labels": decoder.masked_fill(torch.arange(7) >= torch.tensor([[7], [6], [4]]), -100)}


def _model(class_name: str, config_name: str, **config: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        settings = {"vocab_size": VOCAB, "pad_token_id": 0, **config}
        model = getattr(transformers, class_name)(getattr(transformers, config_name)(**settings))
        model.config.use_cache = False
        return model

    return make


def _decoder(name: str, class_name: str, config_name: str, **config: Any) -> Case:
    return Case(name, _model(class_name, config_name, **config), padded_batch)


def _classifier(name: str, class_name: str, config_name: str, **config: Any) -> Case:
    return Case(name, _model(class_name, config_name, num_labels=3, **config), lambda g: padded_batch(g, "classes"))


DECODER = {**SMALL, "max_position_embeddings": 64}
HF_CASES = [
    _decoder("hf_llama", "LlamaForCausalLM", "LlamaConfig", **DECODER, num_key_value_heads=2),
    _decoder("hf_qwen2", "Qwen2ForCausalLM", "Qwen2Config", **DECODER, num_key_value_heads=2),
    _decoder("hf_mistral", "MistralForCausalLM", "MistralConfig", **DECODER, num_key_value_heads=2),
    _decoder("hf_phi3", "Phi3ForCausalLM", "Phi3Config", **DECODER, num_key_value_heads=2),
    _decoder("hf_gemma", "GemmaForCausalLM", "GemmaConfig", **DECODER, num_key_value_heads=2, head_dim=8),
    _decoder(
        "hf_gpt2",
        "GPT2LMHeadModel",
        "GPT2Config",
        n_embd=32,
        n_layer=1,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    _decoder(
        "hf_opt",
        "OPTForCausalLM",
        "OPTConfig",
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        dropout=0.0,
    ),
    _decoder("hf_gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", **DECODER, hidden_dropout=0.0),
    _classifier("hf_bert", "BertForSequenceClassification", "BertConfig", **SMALL, **NO_DROPOUT),
    _classifier("hf_roberta", "RobertaForSequenceClassification", "RobertaConfig", **SMALL, **NO_DROPOUT),
    _classifier(
        "hf_albert",
        "AlbertForSequenceClassification",
        "AlbertConfig",
        **SMALL,
        **NO_DROPOUT,
        embedding_size=16,
        classifier_dropout_prob=0.0,
    ),
    _classifier(
        "hf_distilbert",
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        dim=32,
        hidden_dim=64,
        n_layers=1,
        n_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
    ),
    _classifier(
        "hf_deberta_v2",
        "DebertaV2ForSequenceClassification",
        "DebertaV2Config",
        **SMALL,
        **NO_DROPOUT,
        max_position_embeddings=64,
        pooler_dropout=0.0,
    ),
    Case(
        "hf_t5",
        _model(
            "T5ForConditionalGeneration",
            "T5Config",
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
        seq2seq_batch,
    ),
    Case(
        "hf_bart",
        _model(
            "BartForConditionalGeneration",
            "BartConfig",
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        seq2seq_batch,
    ),
]
