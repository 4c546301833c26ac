"""Hugging Face ``transformers`` models for the `hf` tests, built from tiny configs with random weights.

Nothing is downloaded (conftest.py sets ``HF_HUB_OFFLINE=1``): every model comes from a config object, the
way ``AutoModel.from_config`` builds one, and every batch from a seeded generator. Each factory returns an
:class:`HFCase`: the model, ``make_batch(step)`` (keyword arguments of the model's forward, labels
included, the same every time it is asked for a step) and the inputs ``generate()`` starts from (None for
models that do not generate). Dropout is 0 everywhere, so a step is a function of weights and batch.

Sizes are chosen so that no single parameter is more than ~1/6 of the model (the token embedding is the
largest), which leaves a device budget of 0.6x the parameter bytes room to stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as tf
from torch import nn

VOCAB = 96
SEQ = 8
BATCH = 2


@dataclass
class HFCase:
    model: nn.Module
    make_batch: Callable[[int], dict]
    prompt: dict | None  # keyword arguments of generate(); None: the model does not generate


def _gen(step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(7919 * salt + step)


def _build(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    return model.float().train()


def _counting(step: int, salt: int, batch: int = BATCH, seq: int = SEQ, low: int = 3) -> torch.Tensor:
    """Token ids counting up from a random start: learnable, so gradients carry signal."""
    start = torch.randint(low, VOCAB, (batch, 1), generator=_gen(step, salt))
    return low + (start - low + torch.arange(seq)) % (VOCAB - low)


def _causal_lm(model: nn.Module, salt: int) -> HFCase:
    def make_batch(step):
        ids = _counting(step, salt)
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself

    prompt = {"input_ids": _counting(10_000, salt, batch=1, seq=4)}
    return HFCase(model, make_batch, prompt)


def gpt2() -> HFCase:
    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=128, n_layer=3, n_head=4,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    return _causal_lm(_build(11, lambda: tf.GPT2LMHeadModel(config)), 11)


def llama() -> HFCase:
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return _causal_lm(_build(12, lambda: tf.LlamaForCausalLM(config)), 12)


def opt() -> HFCase:
    config = tf.OPTConfig(vocab_size=VOCAB, hidden_size=128, ffn_dim=512, num_hidden_layers=3,
                          num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=128,
                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _causal_lm(_build(13, lambda: tf.OPTForCausalLM(config)), 13)


def bert_mlm() -> HFCase:
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=512, max_position_embeddings=32, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = _build(14, lambda: tf.BertForMaskedLM(config))
    mask_id = 1

    def make_batch(step):
        g = _gen(step, 14)
        ids = _counting(step, 14)
        attention_mask = torch.ones_like(ids)
        attention_mask[1, SEQ - 2:] = 0  # the second sequence ends in two padding tokens
        masked = (torch.rand(ids.shape, generator=g) < 0.3) & attention_mask.bool()
        masked[:, 0] = True  # at least one prediction per sequence
        return {"input_ids": torch.where(masked, mask_id, ids), "attention_mask": attention_mask,
                "labels": torch.where(masked, ids, -100)}

    return HFCase(model, make_batch, None)


def t5() -> HFCase:
    """Encoder-decoder; encoder, decoder and LM head share one embedding matrix."""
    config = tf.T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2,
                         num_heads=4, dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=2)
    model = _build(15, lambda: tf.T5ForConditionalGeneration(config))

    def make_batch(step):
        ids = _counting(step, 15)
        return {"input_ids": ids, "labels": torch.flip(ids, dims=[1])}  # learn to reverse

    return HFCase(model, make_batch, {"input_ids": _counting(10_000, 15, batch=1, seq=6)})


def vit() -> HFCase:
    config = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=128, num_hidden_layers=3,
                          num_attention_heads=4, intermediate_size=512, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, num_labels=5)
    model = _build(16, lambda: tf.ViTForImageClassification(config))
    teacher = torch.randn(5, 3 * 16 * 16, generator=_gen(0, 160))

    def make_batch(step):
        images = torch.randn(1, 3, 16, 16, generator=_gen(step, 16))  # one image: activations stay small
        return {"pixel_values": images, "labels": (images.flatten(1) @ teacher.T).argmax(1)}

    return HFCase(model, make_batch, None)


CASES: dict[str, Callable[[], HFCase]] = {
    "gpt2": gpt2,
    "bert_mlm": bert_mlm,
    "llama": llama,
    "t5": t5,
    "opt": opt,
    "vit": vit,
}
