"""Parity with TRL 1.16's own loss code on the same inputs (TRL is test-only: skipped without it).

TRL's ``DPOTrainer._compute_loss`` runs unchanged on a bare ``DPOTrainer`` object whose "models" return given
per-token quantities (what TRL's fused LM head returns: ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``,
``log_sum_sq_probs``), so no TRL training runs. Our side gets the same per-token values in packed order and goes
through the training path's own code: :func:`~pair_dpo_trainer.modeling.logprobs.sequence_logps_from_tokens` (LD-DPO
weights
from :func:`~pair_dpo_trainer.losses.length_weights.length_desensitized_weights`), ``pair_logps_from_sequences``, the
objective
and :class:`~pair_dpo_trainer.observability.metrics.PairMetrics`. SimPO is compared with TRL's experimental
``CPOTrainer.cpo_loss``; ORPO's whole loss (NLL and odds ratio) and its gradient with TRL's experimental
``ORPOTrainer`` on the bundled tiny Llama (its own tokenisation, collator and forward); TR-DPO's mixing with TRL's
``SyncRefModelCallback``.

Tolerance: 1e-10 absolute/relative in float64 (float32 for ``alpha_divergence``, whose clamp table TRL keys by
float32/bf16/fp16 only: 1e-5). Deliberate differences are asserted as such (see docs/losses.md).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.losses import LossParams, Objective, StepContext
from pair_dpo_trainer.losses.length_weights import length_desensitized_weights
from pair_dpo_trainer.modeling.logprobs import sequence_logps_from_tokens
from pair_dpo_trainer.observability.metrics import PairMetrics
from pair_dpo_trainer.trainer import pair_logps_from_sequences

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402

N_PAIRS = 6
STAT_KEYS = ("mean_logits", "entropy", "is_top1", "log_sum_sq_probs")


class _PerTokenModel(torch.nn.Module):
    """What a model patched with TRL's fused LM head returns, for fixed per-token values ``[2n, L-1]``."""

    is_gradient_checkpointing = False

    def __init__(self, **per_token: torch.Tensor) -> None:
        super().__init__()
        self.per_token = per_token

    def forward(self, **_kwargs):
        return SimpleNamespace(aux_loss=None, **self.per_token)


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


class Case:
    """Random per-token inputs for ``N_PAIRS`` pairs: completion lengths, policy / reference log-probs, statistics."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.float64) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.chosen_lengths = torch.randint(1, 9, (N_PAIRS,), generator=gen).tolist()
        self.rejected_lengths = torch.randint(1, 9, (N_PAIRS,), generator=gen).tolist()
        lengths = self.chosen_lengths + self.rejected_lengths  # TRL's batch: all chosen rows, then all rejected
        width = max(lengths) + 1
        self.completion_mask = torch.zeros(2 * N_PAIRS, width, dtype=torch.int64)
        for row, length in enumerate(lengths):
            self.completion_mask[row, 1 : 1 + length] = 1  # position 0 is the (one-token) prompt
        scored = self.completion_mask[:, 1:].bool()

        def per_token(low: float, high: float) -> torch.Tensor:
            values = low + (high - low) * torch.rand(2 * N_PAIRS, width - 1, generator=gen, dtype=dtype)
            return values.masked_fill(~scored, 0.0)

        self.policy = per_token(-3.0, -0.05).requires_grad_(True)
        self.ref = per_token(-3.0, -0.05)
        self.stats = {
            "mean_logits": per_token(-2.0, 2.0),
            "entropy": per_token(0.1, 4.0),
            "is_top1": per_token(0.0, 1.0) > 0.5,
            "log_sum_sq_probs": per_token(-4.0, -0.5),
        }
        self.scored = scored

    # ---------------------------------------------------------------- TRL
    def trl(self, loss_type: list[str], **options):
        """TRL's loss and logged metrics for these inputs (``DPOTrainer._compute_loss`` on a bare object)."""
        trainer = DPOTrainer.__new__(DPOTrainer)
        values = {
            "beta": 0.1,
            "loss_weights": None,
            "ld_alpha": None,
            "f_divergence_type": "reverse_kl",
            "f_alpha_divergence_coef": 0.5,
            "label_smoothing": 0.0,
            "use_weighting": False,
            **options,
        }
        trainer.__dict__.update(
            loss_types=list(loss_type),
            precompute_ref_logps=False,
            aux_loss_enabled=False,
            accelerator=_Accelerator(),
            args=SimpleNamespace(discopop_tau=values.pop("discopop_tau", 0.05), gradient_checkpointing_kwargs=None),
            model=_PerTokenModel(log_probs=self.policy, **self.stats),
            ref_model=_PerTokenModel(log_probs=self.ref),
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
            _total_train_tokens=0,
            _tp_size=1,
            **values,
        )
        trainer.loss_weights = values["loss_weights"] or [1.0] * len(loss_type)
        inputs = {
            "input_ids": torch.zeros_like(self.completion_mask),
            "attention_mask": torch.ones_like(self.completion_mask),
            "completion_mask": self.completion_mask,
        }
        loss = DPOTrainer._compute_loss(trainer, trainer.model, inputs, return_outputs=False)
        return loss, {key: values[0] for key, values in trainer._metrics["train"].items()}

    # ---------------------------------------------------------------- ours
    def packed_batch(self):
        features = [
            {"prompt_input_ids": [5], "chosen_input_ids": [7] * c, "rejected_input_ids": [8] * r}
            for c, r in zip(self.chosen_lengths, self.rejected_lengths, strict=True)
        ]
        return PackedPairCollator()(features)

    def _packed(self, per_token: torch.Tensor) -> torch.Tensor:
        """TRL's ``[2n, L-1]`` layout -> our scored tokens in packed order (pair by pair, chosen first)."""
        rows = []
        for pair in range(N_PAIRS):
            for row in (pair, N_PAIRS + pair):
                rows.append(per_token[row][self.scored[row]])
        return torch.cat(rows)

    def ours(
        self, loss_type: list[str], *, loss_weights=None, ld_alpha=None, use_weighting=False, context=None, **params
    ):
        """Our per-pair mean loss and metrics from the same per-token values, through the training path's code."""
        batch = self.packed_batch()
        if ld_alpha is not None:
            batch = batch.__class__(**{**batch.__dict__, "token_weights": length_desensitized_weights(batch, ld_alpha)})
        sequences = batch.sequence_index.reshape(-1).index_select(0, batch.completion_positions)
        stats = torch.stack([self._packed(self.stats[key].to(self.policy.dtype)) for key in STAT_KEYS], dim=1)
        policy = sequence_logps_from_tokens(self._packed(self.policy), stats, sequences, batch)
        ref = sequence_logps_from_tokens(self._packed(self.ref), None, sequences, batch).logps
        pair = pair_logps_from_sequences(policy, ref, batch)
        objective = Objective(loss_type, loss_weights, LossParams(**params), use_weighting=use_weighting)
        output = objective(pair, context or StepContext())
        metrics = PairMetrics(objective.names)
        metrics.update(pair, output.losses, params.get("beta", 0.1), token_stats=policy.token_stats)
        return output.losses.mean(), metrics.reduce(torch.device("cpu"))


CASES = {
    # name: (TRL loss_type and options, our loss_type and options)
    "sigmoid": ((["sigmoid"], {}), (["sigmoid"], {})),
    "hinge": ((["hinge"], {"beta": 0.5}), (["hinge"], {"beta": 0.5})),
    "ipo": ((["ipo"], {}), (["ipo"], {})),
    "exo_pair": ((["exo_pair"], {"label_smoothing": 1e-3}), (["exo_pair"], {"label_smoothing": 1e-3})),  # 1e-7
    "nca_pair": ((["nca_pair"], {}), (["nca_pair"], {})),
    "robust": ((["robust"], {"label_smoothing": 0.1}), (["robust"], {"label_smoothing": 0.1})),
    "bco_pair": ((["bco_pair"], {}), (["bco_pair"], {})),
    "sppo_hard": ((["sppo_hard"], {}), (["sppo_hard"], {})),
    "aot": ((["aot"], {"label_smoothing": 0.1}), (["aot"], {"label_smoothing": 0.1})),
    "aot_unpaired": ((["aot_unpaired"], {}), (["aot_unpaired"], {})),
    "apo_zero": ((["apo_zero"], {}), (["apo_zero"], {})),
    "apo_down": ((["apo_down"], {}), (["apo_down"], {})),
    "discopop": (
        (["discopop"], {"beta": 2.0, "discopop_tau": 0.1}),
        (["discopop"], {"beta": 2.0, "discopop_tau": 0.1}),
    ),
    "sft": ((["sft"], {}), (["sft"], {})),
    "sigmoid_norm": ((["sigmoid_norm"], {}), (["sigmoid_norm"], {})),
    "mpo mixture": (
        (["sigmoid", "bco_pair", "sft"], {"loss_weights": [0.8, 0.2, 1.0]}),
        (["sigmoid", "bco_pair", "sft"], {"loss_weights": [0.8, 0.2, 1.0]}),
    ),
    "ld_alpha sigmoid": ((["sigmoid"], {"ld_alpha": 0.3}), (["sigmoid"], {"ld_alpha": 0.3})),
    "ld_alpha ipo + sft": ((["ipo", "sft"], {"ld_alpha": 0.0}), (["ipo", "sft"], {"ld_alpha": 0.0})),
    "wpo sigmoid": ((["sigmoid"], {"use_weighting": True}), (["sigmoid"], {"use_weighting": True})),
    "wpo mixture": (
        (["sigmoid", "sigmoid_norm"], {"use_weighting": True, "loss_weights": [1.0, 0.5]}),
        (["sigmoid", "sigmoid_norm"], {"use_weighting": True, "loss_weights": [1.0, 0.5]}),
    ),
    "forward_kl": (
        (["sigmoid", "ipo"], {"f_divergence_type": "forward_kl"}),
        (["sigmoid", "ipo"], {"f_divergence_type": "forward_kl"}),
    ),
    "js_divergence": ((["discopop"], {"f_divergence_type": "js_divergence"}),) * 2,
}
PARITY_TOLERANCE = 1e-10
LOOSER = {"exo_pair": 1e-7}
"""TRL builds EXO's epsilon as a float32 tensor (``torch.tensor(label_smoothing)``): log(eps) has float32 rounding."""


def _split(options: dict):
    loader = {k: options[k] for k in ("loss_weights", "ld_alpha", "use_weighting") if k in options}
    params = {k: v for k, v in options.items() if k not in loader}
    return loader, params


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_equal_trl_on_the_same_per_token_inputs(name):
    (trl_types, trl_options), (our_types, our_options) = CASES[name]
    case = Case(seed=sorted(CASES).index(name))
    tolerance = LOOSER.get(name, PARITY_TOLERANCE)
    trl_loss, _ = case.trl(trl_types, **trl_options)
    (trl_grad,) = torch.autograd.grad(trl_loss, case.policy)
    loader, params = _split(our_options)
    our_loss, _ = case.ours(our_types, **loader, **params)
    (our_grad,) = torch.autograd.grad(our_loss, case.policy)
    assert float(our_loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=tolerance, abs=tolerance)
    # TRL's sum runs over every position; the fused head zeroes the unscored ones, so only scored ones carry gradient
    scored = case.scored
    torch.testing.assert_close(our_grad[scored], trl_grad[scored], rtol=tolerance, atol=tolerance)
    assert float(our_grad[~scored].abs().max()) == 0.0


def test_alpha_divergence_equals_trl_in_float32():
    case = Case(seed=99, dtype=torch.float32)
    options = {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}
    trl_loss, _ = case.trl(["sigmoid", "hinge"], **options)
    our_loss, _ = case.ours(["sigmoid", "hinge"], **options)
    assert float(our_loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-6)


def test_metrics_equal_trl_names_and_values():
    """Every TRL metric of the same quantity has the same name and, on one micro-batch, the same value."""
    case = Case(seed=5)
    _, trl_metrics = case.trl(["sigmoid"])
    _, ours = case.ours(["sigmoid"])
    shared = [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "entropy",
        "mean_token_accuracy",
    ]
    assert set(trl_metrics) == {*shared, "num_tokens"}
    for key in shared:  # TRL divides the token counts in float32 for mean_token_accuracy
        tolerance = 1e-7 if key == "mean_token_accuracy" else 1e-9
        assert ours[key] == pytest.approx(trl_metrics[key], rel=tolerance, abs=tolerance), key


def test_trl_ignores_label_smoothing_for_sigmoid_and_we_honour_cdpo():
    """A deliberate difference (docs/losses.md): TRL 1.16's 'sigmoid' drops label_smoothing; ours is cDPO."""
    case = Case(seed=6)
    trl_smoothed, _ = case.trl(["sigmoid"], label_smoothing=0.2)
    trl_plain, _ = case.trl(["sigmoid"])
    ours_plain, _ = case.ours(["sigmoid"])
    ours_smoothed, _ = case.ours(["sigmoid"], label_smoothing=0.2)
    assert float(trl_smoothed) == pytest.approx(float(trl_plain), abs=1e-12)
    assert float(ours_plain) == pytest.approx(float(trl_plain), abs=1e-10)
    assert abs(float(ours_smoothed) - float(trl_plain)) > 1e-3


def test_trl_cannot_weight_sft_and_we_can():
    """TRL 1.16 multiplies its expanded (one-element) sft loss in place by the WPO weights and raises; ours weights
    the per-pair sft term like any other component."""
    case = Case(seed=8)
    with pytest.raises(RuntimeError, match="single memory location"):
        case.trl(["sft"], use_weighting=True)
    loss, _ = case.ours(["sft"], use_weighting=True)
    assert torch.isfinite(loss) and float(loss) > 0


def test_ipo_is_trl_and_ipo_sum_is_the_papers_summed_form():
    """``ipo`` is TRL's per-token IPO; ``ipo_sum`` squares the summed log-ratio difference (Eq. 17 as written)."""
    case = Case(seed=7)
    trl_ipo, _ = case.trl(["ipo"])
    ours_ipo, _ = case.ours(["ipo"])
    ours_sum, _ = case.ours(["ipo_sum"])
    assert float(ours_ipo) == pytest.approx(float(trl_ipo), rel=1e-10)
    assert abs(float(ours_sum) - float(trl_ipo)) > 1e-2


def test_bco_pair_has_no_reward_shift_as_trl_and_bco_pair_shift_has_one():
    """TRL 1.16's ``bco_pair`` has no reward shift: ours ignores a running delta; ``bco_pair_shift`` subtracts it."""
    case = Case(seed=9)
    trl_loss, _ = case.trl(["bco_pair"])
    shifted = StepContext(bco_delta=0.3)
    ours, _ = case.ours(["bco_pair"], context=shifted)
    ours_shift, _ = case.ours(["bco_pair_shift"], context=shifted)
    assert float(ours) == pytest.approx(float(trl_loss), rel=1e-10)
    assert abs(float(ours_shift) - float(trl_loss)) > 1e-3


def _avg_logps(seed: int):
    gen = torch.Generator().manual_seed(seed)
    chosen = -3.0 * torch.rand(N_PAIRS, generator=gen, dtype=torch.float64) - 0.01
    rejected = -3.0 * torch.rand(N_PAIRS, generator=gen, dtype=torch.float64) - 0.01
    counts = torch.randint(1, 20, (2, N_PAIRS), generator=gen).to(torch.float64)
    return chosen, rejected, counts


def test_simpo_equals_trl_cpo_trainer_simpo_loss():
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    chosen, rejected, counts = _avg_logps(1)
    fake = SimpleNamespace(
        alpha=0.0, beta=2.0, simpo_gamma=0.7, label_smoothing=0.1, loss_type="simpo", accelerator=_Accelerator()
    )
    trl_losses, _, _ = cpo.CPOTrainer.cpo_loss(fake, chosen, rejected)  # TRL takes length-averaged log-probs
    from pair_dpo_trainer.losses import LOSS_FUNCTIONS, PairLogps

    zero = torch.zeros_like(chosen)
    pair = PairLogps(chosen * counts[0], rejected * counts[1], zero, zero, counts[0], counts[1])
    ours = LOSS_FUNCTIONS["simpo"](pair, LossParams(beta=2.0, simpo_gamma=0.7, label_smoothing=0.1))
    torch.testing.assert_close(ours, trl_losses, rtol=PARITY_TOLERANCE, atol=PARITY_TOLERANCE)


ORPO_ROWS = [
    {"prompt": "sort 3 1 2 :", "chosen": " 1 2 3", "rejected": " 3 2 1 9 9"},
    {"prompt": "count up 1 to 5 please a b c d e f :", "chosen": " 1 2 3 4 5", "rejected": " 5"},
    {"prompt": "x :", "chosen": " y z", "rejected": " z y y"},
]


def test_orpo_loss_and_gradient_equal_trl_orpo_trainer():
    """The whole ORPO loss, NLL and odds ratio: TRL's ``ORPOTrainer`` pools the NLL over every token after the first
    of the chosen sequences of its micro-batch (prompt and completion); ours from the same token ids through the
    training path (collator, packed log-probs with the chosen prompts, objective). Float64 model, TRL's odds ratio
    in float32: 1e-6."""
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    from trl.experimental.utils import DPODataCollatorWithPadding

    from pair_dpo_trainer.modeling.attention import enable_pair_varlen
    from pair_dpo_trainer.modeling.logprobs import packed_policy_logps
    from tests.models import demo_llama

    model, tok = demo_llama()
    model = model.double().eval()
    bare = orpo.ORPOTrainer.__new__(orpo.ORPOTrainer)
    bare.__dict__.update(
        processing_class=tok,
        is_encoder_decoder=False,
        max_length=1024,
        padding_value=tok.pad_token_id,
        aux_loss_enabled=False,
        beta=0.1,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    rows = [orpo.ORPOTrainer.tokenize_row(bare, row) for row in ORPO_ROWS]
    batch = DPODataCollatorWithPadding(pad_token_id=tok.pad_token_id)(rows)
    chosen, rejected, _, _, nll = orpo.ORPOTrainer.concatenated_forward(bare, model, batch)
    trl_loss = nll - orpo.ORPOTrainer.odds_ratio_loss(bare, chosen, rejected)[0].mean()
    parameters = [p for p in model.parameters() if p.requires_grad]
    trl_grads = torch.autograd.grad(trl_loss, parameters)

    features = []
    for row in rows:
        prompt = list(row["prompt_input_ids"])
        features.append(
            {
                "prompt_input_ids": prompt,
                "chosen_input_ids": list(row["chosen_input_ids"][len(prompt) :]),
                "rejected_input_ids": list(row["rejected_input_ids"][len(prompt) :]),
            }
        )
    enable_pair_varlen(model, "sdpa_segments")
    packed = PackedPairCollator(score_chosen_prompts=True)(features)
    policy = packed_policy_logps(model, packed, chunk_size=7)
    pair = pair_logps_from_sequences(policy, torch.zeros(2 * len(rows), dtype=torch.float64), packed)
    ours = Objective(["orpo"], None, LossParams(beta=0.1))(pair).losses.mean()
    our_grads = torch.autograd.grad(ours, parameters)
    assert float(ours.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-6, abs=1e-7)
    for mine, theirs in zip(our_grads, trl_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


def test_tr_dpo_mixing_equals_trl_sync_ref_model_callback():
    from trl.trainer.callbacks import SyncRefModelCallback

    from pair_dpo_trainer.reference.sync import mix_into_reference
    from tests.models import tiny_llama

    policy, ours, theirs = tiny_llama(0), tiny_llama(1), tiny_llama(1)
    mix_into_reference(ours, policy, 0.6)
    SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
