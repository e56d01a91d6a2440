"""Every loss variant against an independent float64 formula, values and gradients w.r.t. the logps."""

from __future__ import annotations

import math

import pytest
import torch

from pair_dpo_trainer.loss import LOSS_FUNCTIONS, LossParams, PairLogps


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference_loss(loss_type: str, pc, pr, rc, rr, n_chosen, beta, eps, nll_weight) -> float:
    """Plain-Python float64 formulas written from the papers, independent of pair_dpo_trainer.loss."""
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        return -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
    if loss_type == "robust":
        return (-(1 - eps) * _log_sigmoid(beta * h) + eps * _log_sigmoid(-beta * h)) / (1 - 2 * eps)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return max(0.0, 1 - beta * h)
    if loss_type == "sigmoid_nll":
        return -_log_sigmoid(beta * h) * (1 - eps) - eps * _log_sigmoid(-beta * h) - nll_weight * pc / n_chosen
    raise AssertionError(loss_type)


def _random_logps(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(-50 * torch.rand(n, generator=gen, dtype=torch.float64)).requires_grad_(True) for _ in range(4)]


@pytest.mark.parametrize("loss_type", sorted(LOSS_FUNCTIONS))
@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.0)])
def test_loss_matches_float64_formula_values_and_gradients(loss_type, beta, eps):
    if eps > 0 and loss_type in {"ipo", "hinge"}:
        pytest.skip("label smoothing is rejected by the config for this loss")
    n = 16
    pc, pr, rc, rr = _random_logps(n, seed=7)
    counts = torch.arange(1, n + 1, dtype=torch.float64)
    params = LossParams(beta=beta, label_smoothing=eps, nll_weight=0.7)
    losses = LOSS_FUNCTIONS[loss_type](PairLogps(pc, pr, rc, rr, counts, counts), params)
    assert losses.shape == (n,)
    expected = [
        _reference_loss(loss_type, *(float(t[i].detach()) for t in (pc, pr, rc, rr)), float(counts[i]), beta, eps, 0.7)
        for i in range(n)
    ]
    torch.testing.assert_close(losses.detach(), torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)

    # Gradients: autograd against central finite differences of the independent formula.
    losses.sum().backward()
    step = 1e-6
    for which, tensor in enumerate((pc, pr, rc, rr)):
        for i in (0, n // 2, n - 1):
            args = [float(t[i].detach()) for t in (pc, pr, rc, rr)]
            args_hi, args_lo = list(args), list(args)
            args_hi[which] += step
            args_lo[which] -= step
            f_hi = _reference_loss(loss_type, *args_hi, float(counts[i]), beta, eps, 0.7)
            f_lo = _reference_loss(loss_type, *args_lo, float(counts[i]), beta, eps, 0.7)
            assert float(tensor.grad[i]) == pytest.approx((f_hi - f_lo) / (2 * step), rel=1e-5, abs=1e-7)


def test_sigmoid_loss_is_ln2_when_policy_equals_reference():
    logps = torch.randn(8, dtype=torch.float64)
    pair = PairLogps(logps, logps.flip(0), logps, logps.flip(0), torch.ones(8), torch.ones(8))
    losses = LOSS_FUNCTIONS["sigmoid"](pair, LossParams(beta=0.3))
    torch.testing.assert_close(losses, torch.full((8,), math.log(2), dtype=torch.float64))


def test_rewards_are_beta_scaled_logratios():
    pc, pr, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-3.0, -5.0, -4.0, -4.5))
    pair = PairLogps(pc, pr, rc, rr, torch.ones(1), torch.ones(1))
    assert float(pair.chosen_rewards(0.5)) == pytest.approx(0.5)
    assert float(pair.rejected_rewards(0.5)) == pytest.approx(-0.25)
    assert float(pair.logits()) == pytest.approx(1.5)
