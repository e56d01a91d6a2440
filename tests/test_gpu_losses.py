"""GPU checks of the objectives (run on the GPU machine: ``pytest -m gpu -s tests/test_gpu_losses.py``).

Prints the numbers quoted in docs/benchmarks.md ("Per-token statistics in the chunked head"): peak memory and time
of the chunked log-prob head with and without the per-token statistics (TRL's ``logits/*``, ``entropy``,
``mean_token_accuracy``; WPO's ``log sum p^2``), and a bf16 training step of every objective on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from pair_dpo_trainer.modeling.chunked_head import chunked_token_logps, naive_token_stats
from tests.test_gpu_packed import HEAD_SHAPE, _peak_fwd_bwd, head_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_chunked_head_statistics_cost_and_values() -> None:
    vocab, hidden_size, tokens, chunk = HEAD_SHAPE.values()
    hidden, weight, targets = head_inputs()
    runs = {}
    for name, stats in (("plain", False), ("stats", True)):

        def fn(stats=stats):
            return chunked_token_logps(hidden, weight, targets, chunk, with_stats=stats)

        _peak_fwd_bwd(fn, hidden, weight)  # warm-up
        runs[name] = [_peak_fwd_bwd(fn, hidden, weight) for _ in range(3)]
    plain_peak = min(r[1] for r in runs["plain"])
    stats_peak = min(r[1] for r in runs["stats"])
    plain_ms = sorted(r[2] for r in runs["plain"])[1] * 1e3
    stats_ms = sorted(r[2] for r in runs["stats"])[1] * 1e3
    (_, stats), _, _ = runs["stats"][0]
    sample = slice(0, 512)
    expected = naive_token_stats(hidden[sample].detach(), weight.detach(), targets[sample])
    err = (stats[sample] - expected).abs().max(dim=0).values.tolist()
    print(
        f"\n[gpu] chunked head fwd+bwd V={vocab} N={tokens} H={hidden_size} bf16 chunk {chunk}: "
        f"plain peak {plain_peak:.2f} GiB {plain_ms:.1f} ms; with statistics peak {stats_peak:.2f} GiB "
        f"{stats_ms:.1f} ms; stats max abs diff vs naive (mean logit, entropy, top1, log sum p^2) {err}"
    )
    assert stats_peak < plain_peak * 1.25
    assert max(err) < 1e-2


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": name}
        for name in (
            "sigmoid",
            "ipo",
            "ipo_sum",
            "nca_pair",
            "bco_pair",
            "bco_pair_shift",
            "sppo_hard",
            "aot",
            "aot_unpaired",
        )
        + ("apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft", "simpo", "orpo", "hinge")
    ]
    + [
        {"loss_type": "exo_pair", "label_smoothing": 1e-3},
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"loss_type": "sigmoid", "use_weighting": True, "ld_alpha": 0.5},
        {"loss_type": "sigmoid", "f_divergence_type": "alpha_divergence"},
        {"loss_type": "sigmoid", "sync_ref_model": True, "ref_model_sync_steps": 1},
    ],
    ids=lambda o: "+".join(o["loss_type"]) if isinstance(o["loss_type"], list) else str(o),
)
def test_every_objective_trains_in_bf16_on_the_gpu(tmp_path, options) -> None:
    from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
    from tests.dpo_fixtures import synthetic_pairs
    from tests.models import tiny_llama, tiny_tokenizer

    config = PairDPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-3,
        bf16=True,
        save_strategy="no",
        disable_tqdm=True,
        allow_unpinned_reference=True,
        **options,
    )
    trainer = PairDPOTrainer(
        model=tiny_llama(0).to(torch.bfloat16),
        args=config,
        train_dataset=synthetic_pairs(48),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 3 and all(math.isfinite(e["loss"]) for e in logged)
    assert all(key in logged[-1] for key in ("logits/chosen", "entropy", "mean_token_accuracy", "num_tokens"))
