"""The tiny models every test builds, in one place (random weights, float32, no files, no downloads).

- :func:`tiny_llama`: the trainer tests' 2-layer GQA Llama (vocabulary 64), with :func:`tiny_tokenizer`.
- :func:`tiny_lora_llama`: the same with LoRA adapters (needs ``peft``).
- :func:`sharp_llama`: a wider Llama with a larger initialiser range (sharper logits, vocabulary 101), for the
  attention and log-prob tests, whose differences must stand out of float32 noise.
- :func:`other_architecture_llama`: one layer of other sizes: a reference the policy cannot be mixed with.
- :func:`llama_100m`: a 100M-parameter Llama in bf16 on CUDA, for the GPU tests.
- :func:`demo_llama`: the bundled tiny Llama (4 layers, vocabulary 142) with its tokenizer and chat template, for the
  TRL parity suite (``tests/trl``), with :func:`lora_config`.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 64
EOS = 2
SHARP_VOCAB = 101
GPU_VOCAB = 32000


def tiny_llama(seed: int = 0, vocab_size: int = VOCAB) -> LlamaForCausalLM:
    """A 2-layer GQA Llama, float32, identical for a given seed on every process; ``vocab_size`` embedding rows
    (``len(tokenizer)`` for rows tokenised by a real tokenizer: the trainer refuses ids the embedding lacks)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config).float()


def tiny_lora_llama(seed: int = 0) -> torch.nn.Module:
    """:func:`tiny_llama` with LoRA adapters on ``q_proj`` / ``v_proj`` (rank 4, no dropout, B = 0: the policy equals
    its adapter-disabled reference at step 0). Needs ``peft``."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(tiny_llama(seed), config)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer object for the Trainer's bookkeeping (pairs are given as token ids)."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t2", pad_token="t0", bos_token="t1")


def sharp_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer GQA Llama of width 48 and vocabulary :data:`SHARP_VOCAB` with ``initializer_range=0.2``, on SDPA."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=SHARP_VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).float()
    model.set_attn_implementation("sdpa")
    return model


def other_architecture_llama() -> LlamaForCausalLM:
    """One layer of width 16 over :data:`VOCAB`: not the architecture of :func:`tiny_llama`."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def llama_100m() -> LlamaForCausalLM:
    """A 12-layer Llama of width 768 (about 100M parameters with the 32k vocabulary), bf16 on CUDA, on SDPA."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=GPU_VOCAB,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation("sdpa")
    return model


def demo_llama() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The bundled demo model (float32) and its tokenizer (with a chat template), loaded from the package."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pair_dpo_trainer.demo import bundled_model_dir

    directory = bundled_model_dir()
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), AutoTokenizer.from_pretrained(
        directory
    )


def lora_config():
    """LoRA on ``q_proj`` / ``v_proj`` (rank 4, no dropout): the adapters the parity suite trains. Needs ``peft``."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
