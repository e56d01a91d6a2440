"""The fixed comparison workload, shared by our benchmark (``dpo.py``) and the TRL baseline (``trl_dpo.py``), so the
two sides draw the same pairs and build the same random-init model (:func:`build_model`, the one builder).

* Model sizes (``--model-size``): ``254m`` (Llama: hidden 1024, 16 layers, 16/8 heads, vocab 32000, the TRL
  baseline's model), ``1.5b`` (Llama with Qwen-like width, hidden 2048, 24 layers, vocab 152064, untied head),
  ``qwen1.5b`` (Qwen2-1.5B's shape on the Qwen2 architecture: hidden 1536, 28 layers, intermediate 8960, 12/2 heads,
  vocab 151936, QKV bias, tied head), ``8b`` (Llama-3-8B's shape), and the CPU smoke tests ``tiny`` (Llama) and
  ``tiny-qwen`` (Qwen2, tied head, vocab 512).
* Pairs of token ids drawn with ``numpy.random.default_rng(seed)`` in one fixed call order: prompt U[32, 512]; chosen /
  rejected ``clip(round(lognormal(log 200, 0.9)), 16, 1024)``, each ending with EOS (id 1); ids in [3, V) with
  V = :func:`token_vocab` (VOCAB = 32000, or the model's vocabulary when it is smaller). Or, with ``mix="heavy"``,
  ``sampler.py``'s heavy-tailed mix; or, with ``mix="long"``, the long-prompt mix (:func:`long_prompt_pairs`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from benchmarks.rows import VOCAB
from benchmarks.sampler import mix_lengths

EOS_ID = 1

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "tiny-qwen": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "254m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16),
    # "1.5b": Qwen2-like width and vocabulary on the Llama architecture; untied head like the 254M model. 5632 =
    # 22 x 256 (tensor-core friendly, ~2.75 x hidden). 1.44e9 non-embedding parameters (head included), 1.76e9 in all.
    "1.5b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16),
    # "qwen1.5b": Qwen2-1.5B's shape (Qwen2ForCausalLM: QKV bias, GQA 12/2 heads, tied head): 1.54e9 parameters,
    # all of them counted per token (the tied head's matmul is done once; the embedding lookup is free).
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    # "8b": Llama-3-8B's shape (8.0e9 parameters; GQA 32/8 heads). Fits ONE H200 as the benchmark builds it: bf16
    # weights, so AdamW's states are bf16 too (2 + 2 grads + 4 states = 8 B/param) plus a bf16 reference (2 B/param):
    # ~75 GiB static, leaving ~55 GiB for activations (~10k tokens per micro-batch compiled without activation
    # checkpointing, ~19k checkpointing every 2nd layer). With fp32 master weights and states (16 B/param, ~135 GiB)
    # it needs sharding (multi_gpu.py's large-model suites).
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
}
MODEL_VOCAB = {"tiny": VOCAB, "tiny-qwen": 512, "254m": VOCAB, "1.5b": 152064, "qwen1.5b": 151936, "8b": 128256}
KV_HEADS = {"8b": 8, "qwen1.5b": 2, "tiny-qwen": 2}  # the others: half as many KV heads as query heads
QWEN2 = frozenset({"qwen1.5b", "tiny-qwen"})
"""Sizes built as ``Qwen2ForCausalLM(Qwen2Config(...))`` (QKV bias, tied head); the others as Llama."""
GPU_INIT = frozenset({"1.5b", "qwen1.5b", "8b"})
"""Sizes initialised directly on the GPU (same distribution, another random stream than a CPU init): saves ~20 s of
CPU init per run for the 1.5B models and minutes for the 8B one."""


def token_vocab(size: str) -> int:
    """Token ids of a size's pairs are drawn from ``[3, token_vocab(size))``: :data:`VOCAB`, or the model's
    vocabulary when it is smaller (``tiny-qwen``).

    Example:
        >>> token_vocab("8b"), token_vocab("tiny-qwen")
        (32000, 512)
    """
    return min(VOCAB, MODEL_VOCAB[size])


def make_pairs(n: int, seed: int, mix: str = "trl", vocab: int = VOCAB) -> list[dict[str, list[int]]]:
    """``n`` tokenised pairs, drawn exactly as ``trl_dpo_baseline.make_dataset`` draws them (same RNG call order), or
    with ``mix="heavy"`` the lengths of ``sampler.py``'s heavy-tailed mix (pair cost up to 16,384); ids in
    ``[3, vocab)``.

    Example:
        >>> row = make_pairs(1, seed=0)[0]
        >>> row["chosen_input_ids"][-1], 32 <= len(row["prompt_input_ids"]) <= 512
        (1, True)
    """
    if mix == "heavy":
        return heavy_pairs(n, seed, vocab)
    if mix == "long":
        return long_prompt_pairs(n, seed, vocab)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        lp = int(rng.integers(32, 513))
        lc, lr = (int(np.clip(round(rng.lognormal(math.log(200), 0.9)), 16, 1024)) for _ in range(2))
        rows.append(_pair_ids(rng, lp, lc, lr, vocab))
    return rows


def _pair_ids(rng: np.random.Generator, lp: int, lc: int, lr: int, vocab: int) -> dict[str, list[int]]:
    """One pair of the given lengths: ids drawn in [3, vocab), prompt then chosen then rejected (the draw order every
    mix shares), each completion ending with EOS."""
    return {
        "prompt_input_ids": rng.integers(3, vocab, lp).tolist(),
        "chosen_input_ids": rng.integers(3, vocab, lc - 1).tolist() + [EOS_ID],
        "rejected_input_ids": rng.integers(3, vocab, lr - 1).tolist() + [EOS_ID],
    }


def long_prompt_pairs(n: int, seed: int, vocab: int = VOCAB) -> list[dict[str, list[int]]]:
    """``n`` pairs of the long-prompt mix (retrieval-augmented answers, summaries, multi-turn chats): prompt
    U[8192, 16384], chosen / rejected clip(round(lognormal(log 1000, 0.3)), 256, 2048), each ending with EOS; ids in
    [3, vocab). Here the prompt is most of each sequence, so packing it once per pair saves close to half the tokens.

    Example:
        >>> row = long_prompt_pairs(1, seed=0)[0]
        >>> 8192 <= len(row["prompt_input_ids"]) <= 16384, 256 <= len(row["chosen_input_ids"]) <= 2048
        (True, True)
    """
    rng = np.random.default_rng(seed)

    def completion() -> int:
        return int(np.clip(round(rng.lognormal(math.log(1000), 0.3)), 256, 2048))

    return [_pair_ids(rng, int(rng.integers(8192, 16385)), completion(), completion(), vocab) for _ in range(n)]


def heavy_pairs(n: int, seed: int, vocab: int = VOCAB) -> list[dict[str, list[int]]]:
    """``n`` pairs with ``sampler.mix_lengths("heavy")``: prompt clip(lognormal(log 300, 1), 16, 4096), chosen /
    rejected clip(lognormal(log 150, 1.5), 8, 4096), each ending with EOS; ids in [3, vocab)."""
    rng = np.random.default_rng(seed)
    lengths = zip(*(x.tolist() for x in mix_lengths("heavy", n, rng)), strict=True)
    return [_pair_ids(rng, lp, lc, lr, vocab) for lp, lc, lr in lengths]


def make_tokenizer() -> Any:
    """The TRL script's word-level tokenizer (pad 0, EOS 1, unk 2); the trainer reads only its pad id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def model_dims(size: str) -> dict[str, Any]:
    """The config keyword arguments of a ``--model-size``: ``LlamaConfig``'s (GQA with half as many KV heads as query
    heads unless :data:`KV_HEADS` says otherwise), or ``Qwen2Config``'s for :data:`QWEN2` sizes (tied head, Qwen2's
    32k positions)."""
    dims: dict[str, Any] = dict(MODEL_SIZES[size])
    kv_heads = KV_HEADS.get(size, dims["num_attention_heads"] // 2)
    dims.update(num_key_value_heads=kv_heads, vocab_size=MODEL_VOCAB[size])
    if size in QWEN2:
        return {**dims, "max_position_embeddings": 32768, "tie_word_embeddings": True}
    return {**dims, "max_position_embeddings": 4096}


def model_config(size: str, attn: str | None = None) -> Any:
    """The ``LlamaConfig`` or ``Qwen2Config`` of a size; ``attn`` sets ``_attn_implementation`` (TRL's ``--attn``)."""
    from transformers import LlamaConfig, Qwen2Config

    config = (Qwen2Config if size in QWEN2 else LlamaConfig)(**model_dims(size))
    if attn is not None:
        config._attn_implementation = attn
    return config


def build_model(
    size: str,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attn: str | None = None,
) -> torch.nn.Module:
    """The random-init model of a size (``Qwen2ForCausalLM`` for :data:`QWEN2`, else ``LlamaForCausalLM``), cast to
    ``dtype`` (None: float32) and on ``device``: what both sides of the comparison train.

    ``torch.manual_seed(seed)`` first; :data:`GPU_INIT` sizes are initialised on a CUDA ``device`` directly, the others
    on the CPU (the TRL script's way). After a GPU init in float32 the cached float32 blocks are released, so the run
    starts from what the model holds.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    device = torch.device(device)
    torch.manual_seed(seed)
    on_gpu = device.type == "cuda" and size in GPU_INIT
    with device if on_gpu else torch.device("cpu"):
        model = (Qwen2ForCausalLM if size in QWEN2 else LlamaForCausalLM)(model_config(size, attn))
    if dtype is not None:
        model = model.to(dtype)
    model = model.to(device)
    if on_gpu:
        torch.cuda.empty_cache()
    return model


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linears both sides put LoRA adapters on (``--lora R``): every projection of the attention and the MLP."""


def lora_config(rank: int) -> Any:
    """The ``peft.LoraConfig`` of ``--lora R`` on both sides: rank R on :data:`LORA_TARGETS`, alpha 2R, dropout 0."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"
    )


def trl_rows(n: int, seed: int, vocab: int = VOCAB) -> dict[str, list[list[int]]]:
    """The same ``n`` pairs as :func:`make_pairs` (``mix="trl"``) in TRL's column layout: ``prompt_ids``,
    ``chosen_ids``, ``rejected_ids`` (what TRL's DPO collator reads from a pre-tokenised dataset)."""
    rows = make_pairs(n, seed, vocab=vocab)
    return {f"{key}_ids": [r[f"{key}_input_ids"] for r in rows] for key in ("prompt", "chosen", "rejected")}
