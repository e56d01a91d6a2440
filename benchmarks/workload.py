"""The fixed comparison workload, shared by our benchmark (``dpo.py``) and the TRL baseline (``trl_dpo.py``), so the
two sides draw the same pairs and build the same random-init Llama.

* Model sizes (``--model-size``): ``254m`` (hidden 1024, 16 layers, 16/8 heads, vocab 32000, the TRL baseline's
  model), ``1.5b`` (hidden 2048, 24 layers, vocab 152064), ``8b`` (Llama-3-8B's shape) and ``tiny`` (a CPU smoke test).
* Pairs of token ids drawn with ``numpy.random.default_rng(seed)`` in one fixed call order: prompt U[32, 512]; chosen /
  rejected ``clip(round(lognormal(log 200, 0.9)), 16, 1024)``, each ending with EOS (id 1); ids in [3, VOCAB). Or,
  with ``mix="heavy"``, ``sampler.py``'s heavy-tailed mix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.rows import VOCAB
from benchmarks.sampler import mix_lengths

EOS_ID = 1

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "254m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16),
    # "1.5b": Qwen2-like width and vocabulary on the Llama architecture; untied head like the 254M model. 5632 =
    # 22 x 256 (tensor-core friendly, ~2.75 x hidden). 1.44e9 non-embedding parameters (head included), 1.76e9 in all.
    "1.5b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16),
    # "8b": Llama-3-8B's shape (8.0e9 parameters; GQA 32/8 heads): with its reference and fp32 Adam state ~144 GB,
    # more than one H200 holds, so it runs sharded only (benchmarks/multi_gpu.py).
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
}
MODEL_VOCAB = {"tiny": VOCAB, "254m": VOCAB, "1.5b": 152064, "8b": 128256}
KV_HEADS = {"8b": 8}  # the others: half as many KV heads as query heads


def make_pairs(n: int, seed: int, mix: str = "trl") -> list[dict[str, list[int]]]:
    """``n`` tokenised pairs, drawn exactly as ``trl_dpo_baseline.make_dataset`` draws them (same RNG call order), or
    with ``mix="heavy"`` the lengths of ``sampler.py``'s heavy-tailed mix (pair cost up to 16,384).

    Example:
        >>> row = make_pairs(1, seed=0)[0]
        >>> row["chosen_input_ids"][-1], 32 <= len(row["prompt_input_ids"]) <= 512
        (1, True)
    """
    if mix == "heavy":
        return heavy_pairs(n, seed)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        lp = int(rng.integers(32, 513))
        lc, lr = (int(np.clip(round(rng.lognormal(math.log(200), 0.9)), 16, 1024)) for _ in range(2))
        rows.append(
            {
                "prompt_input_ids": rng.integers(3, VOCAB, lp).tolist(),
                "chosen_input_ids": rng.integers(3, VOCAB, lc - 1).tolist() + [EOS_ID],
                "rejected_input_ids": rng.integers(3, VOCAB, lr - 1).tolist() + [EOS_ID],
            }
        )
    return rows


def heavy_pairs(n: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` pairs with ``sampler.mix_lengths("heavy")``: prompt clip(lognormal(log 300, 1), 16, 4096), chosen /
    rejected clip(lognormal(log 150, 1.5), 8, 4096), each ending with EOS; ids in [3, VOCAB)."""
    rng = np.random.default_rng(seed)
    lengths = zip(*(x.tolist() for x in mix_lengths("heavy", n, rng)), strict=True)
    return [
        {
            "prompt_input_ids": rng.integers(3, VOCAB, lp).tolist(),
            "chosen_input_ids": rng.integers(3, VOCAB, lc - 1).tolist() + [EOS_ID],
            "rejected_input_ids": rng.integers(3, VOCAB, lr - 1).tolist() + [EOS_ID],
        }
        for lp, lc, lr in lengths
    ]


def make_tokenizer() -> Any:
    """The TRL script's word-level tokenizer (pad 0, EOS 1, unk 2); the trainer reads only its pad id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def model_dims(size: str) -> dict[str, int]:
    """``LlamaConfig`` keyword arguments of a ``--model-size`` (GQA with half as many KV heads as query heads)."""
    dims = dict(MODEL_SIZES[size])
    kv_heads = KV_HEADS.get(size, dims["num_attention_heads"] // 2)
    dims.update(num_key_value_heads=kv_heads, vocab_size=MODEL_VOCAB[size])
    return {**dims, "max_position_embeddings": 4096}


def trl_rows(n: int, seed: int) -> dict[str, list[list[int]]]:
    """The same ``n`` pairs as :func:`make_pairs` (``mix="trl"``) in TRL's column layout: ``prompt_ids``,
    ``chosen_ids``, ``rejected_ids`` (what TRL's DPO collator reads from a pre-tokenised dataset)."""
    rows = make_pairs(n, seed)
    return {f"{key}_ids": [r[f"{key}_input_ids"] for r in rows] for key in ("prompt", "chosen", "rejected")}
