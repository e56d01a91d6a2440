"""Shared builders for trainer tests: a tiny random Llama and synthetic tokenised pairs (no files, no downloads)."""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 64
EOS = 2


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer GQA Llama, float32, identical for a given seed on every process."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
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


def synthetic_pairs(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` tokenised pairs with varied lengths; completions end with EOS and chosen != rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 12))]
        chosen = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 10))] + [EOS]
        rejected = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 10))] + [EOS]
        if rejected == chosen:
            rejected = [4] + rejected
        rows.append({"prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected})
    return rows


def cpu_config(tmp_path, **overrides):
    """A ``PairDPOConfig`` for single-process CPU tests (unpinned in-memory reference allowed); overrides win."""
    from pair_dpo_trainer import PairDPOConfig

    options = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        allow_unpinned_reference=True,
    )
    options.update(overrides)
    return PairDPOConfig(**options)


def run_setup(**overrides):
    """A ``training.checks.RunSetup`` of a single-process CPU run (no DeepSpeed, no FSDP, no PEFT, no ``ref_model``)."""
    from pair_dpo_trainer.training.checks import RunSetup

    fields = {
        "deepspeed_config": None,
        "fsdp_plugin": None,
        "process_group": False,
        "peft_policy": False,
        "ref_model_given": False,
        "attn_backend": "sdpa_segments",
        "zero3": False,
    }
    return RunSetup(**{**fields, **overrides})


def runtime_error(args, **overrides):
    """The ``ConfigError`` the trainer's one runtime check raises for ``args`` in that setup (None: none)."""
    from pair_dpo_trainer.errors import ConfigError, raise_problems
    from pair_dpo_trainer.training.checks import run_problems

    try:
        raise_problems(run_problems(args, run_setup(**overrides)))
    except ConfigError as error:
        return error
    return None


def random_features(
    seed: int | random.Random,
    n: int,
    *,
    vocab: int,
    prompt_len: tuple[int, int],
    completion_len: tuple[int, int],
    first_id: int = 1,
) -> list[dict[str, list[int]]]:
    """``n`` tokenised pairs of random ids in ``[first_id, vocab)`` with lengths drawn from the given ranges.

    Args:
        seed: A seed or a ``random.Random`` to draw from.
        n: Number of pairs.
        vocab: Exclusive upper bound of the ids.
        prompt_len / completion_len: Inclusive ``(low, high)`` lengths of the prompt and of each completion.
        first_id: Smallest id (keep special ids out).
    """
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)

    def ids(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(first_id, vocab) for _ in range(rng.randint(*bounds))]

    return [
        {
            "prompt_input_ids": ids(prompt_len),
            "chosen_input_ids": ids(completion_len),
            "rejected_input_ids": ids(completion_len),
        }
        for _ in range(n)
    ]


def block_mask_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """``torch.nn.attention.varlen.varlen_attn`` semantics with dense SDPA and a block-causal mask (traceable, CPU)."""
    import torch.nn.functional as F

    n = q.shape[0]
    pos = torch.arange(n, device=q.device)
    seg = torch.searchsorted(cu_q[1:].to(torch.int64), pos, right=True)
    mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    if window_size[0] >= 0:
        mask &= (pos[:, None] - pos[None, :]) <= window_size[0]
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def install_traceable_varlen(monkeypatch) -> str:
    """Makes attention backend ``torch_varlen`` available on the CPU with :func:`block_mask_varlen_attn` as its kernel
    (undone by ``monkeypatch``); returns the backend name."""
    from pair_dpo_trainer.modeling import attention

    monkeypatch.setattr(attention, "_RESOLVED", {})
    monkeypatch.setitem(attention._KERNELS, "torch_varlen", block_mask_varlen_attn)
    monkeypatch.setitem(attention._GQA_KWARGS, "torch_varlen", True)
    real = attention._unavailable_reason
    monkeypatch.setattr(
        attention, "_unavailable_reason", lambda b, d, t: None if b == "torch_varlen" else real(b, d, t)
    )
    return "torch_varlen"
