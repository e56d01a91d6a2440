"""Every objective against an independent float64 formula written from its paper (plain Python ``math``, nothing
from pair_dpo_trainer.losses), values and gradients w.r.t. the log-probs (central finite differences)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pair_dpo_trainer.losses import LOSS_FUNCTIONS, OBJECTIVES, LossParams, Objective, PairLogps, StepContext


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return math.exp(_log_sigmoid(x))


def _smoothed(z: float, eps: float) -> float:
    """cDPO (Mitchell 2023): -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)."""
    return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)


@dataclass
class Pair:
    """One pair's inputs and the hyper-parameters, as plain floats."""

    pc: float
    pr: float
    rc: float
    rr: float
    nc: float
    nr: float
    b: float = 0.1
    eps: float = 0.0
    nll_weight: float = 0.7
    tau: float = 0.05
    gamma: float = 0.5
    delta: float = 0.0
    pp: float = 0.0
    npp: float = 0.0

    @property
    def uw(self) -> float:
        return self.pc - self.rc

    @property
    def ul(self) -> float:
        return self.pr - self.rr

    @property
    def h(self) -> float:
        return self.uw - self.ul


def _orpo_batch(pairs: list[Pair]) -> float:
    # Hong et al. 2024 Eq. 4/6/7: odds = P / (1 - P), P = exp(mean completion log-prob); L = NLL - lambda log sigmoid(.)
    # with TRL's ORPOTrainer NLL: one token mean over the chosen prompt (pp, npp) and completion (pc, nc) tokens, times
    # the pair count (the trainer divides the sum by the pairs)
    nll = -sum(p.pc + p.pp for p in pairs) / sum(p.nc + p.npp for p in pairs)
    total = 0.0
    for p in pairs:
        mc, mr = p.pc / p.nc, p.pr / p.nr
        log_odds = (mc - math.log(1 - math.exp(mc))) - (mr - math.log(1 - math.exp(mr)))
        total += nll - p.b * _log_sigmoid(log_odds)
    return total


def _discopop(p: Pair) -> float:
    # Lu et al. 2024 Eq. 5
    z = p.b * p.h
    m = _sigmoid(z / p.tau)
    return (1 - m) * -_log_sigmoid(z) + m * math.exp(-z)


def _exo(p: Pair) -> float:
    # Ji et al. 2024 Eq. 16, K = 2
    z = p.b * p.h
    return _sigmoid(z) * (_log_sigmoid(z) - math.log(1 - p.eps)) + _sigmoid(-z) * (_log_sigmoid(-z) - math.log(p.eps))


PER_PAIR = {
    "sigmoid": lambda p: _smoothed(p.b * p.h, p.eps),
    "robust": lambda p: (-(1 - p.eps) * _log_sigmoid(p.b * p.h) + p.eps * _log_sigmoid(-p.b * p.h)) / (1 - 2 * p.eps),
    "ipo": lambda p: (p.uw / p.nc - p.ul / p.nr - 1 / (2 * p.b)) ** 2,
    "ipo_sum": lambda p: (p.h - 1 / (2 * p.b)) ** 2,
    "hinge": lambda p: max(0.0, 1 - p.b * p.h),
    "exo_pair": _exo,
    "nca_pair": lambda p: -_log_sigmoid(p.b * p.uw) - 0.5 * _log_sigmoid(-p.b * p.uw) - 0.5 * _log_sigmoid(-p.b * p.ul),
    "bco_pair": lambda p: -_log_sigmoid(p.b * p.uw) - _log_sigmoid(-p.b * p.ul),
    "bco_pair_shift": lambda p: -_log_sigmoid(p.b * p.uw - p.delta) - _log_sigmoid(-(p.b * p.ul - p.delta)),
    "sppo_hard": lambda p: (p.uw - 0.5 / p.b) ** 2 + (p.ul + 0.5 / p.b) ** 2,
    "apo_zero": lambda p: 1 - _sigmoid(p.b * p.uw) + _sigmoid(p.b * p.ul),
    "apo_down": lambda p: _sigmoid(p.b * p.uw) + 1 - _sigmoid(p.b * (p.uw - p.ul)),
    "discopop": _discopop,
    "sigmoid_norm": lambda p: -_log_sigmoid(p.b * (p.uw / p.nc - p.ul / p.nr)),
    "sigmoid_nll": lambda p: _smoothed(p.b * p.h, p.eps) - p.nll_weight * p.pc / p.nc,
    "simpo": lambda p: _smoothed(p.b * (p.pc / p.nc - p.pr / p.nr) - p.gamma, p.eps),
}
"""Objectives whose loss is a function of one pair alone."""


def _sorted_pairs(xs: list[float], ys: list[float]) -> list[tuple[float, float]]:
    return list(zip(sorted(xs), sorted(ys), strict=True))


def _aot_batch(pairs: list[Pair]) -> float:
    # Melnyk et al. 2024: logistic loss on sorted policy margins minus sorted reference margins, summed
    b, eps = pairs[0].b, pairs[0].eps
    rows = _sorted_pairs([p.pc - p.pr for p in pairs], [p.rc - p.rr for p in pairs])
    return sum(_smoothed(b * (x - y), eps) for x, y in rows)


def _aot_unpaired_batch(pairs: list[Pair]) -> float:
    b, eps = pairs[0].b, pairs[0].eps
    return sum(_smoothed(b * (x - y), eps) for x, y in _sorted_pairs([p.uw for p in pairs], [p.ul for p in pairs]))


def _sft_batch(pairs: list[Pair]) -> float:
    # token mean of the chosen NLL, times the pair count (the trainer divides the sum by the pairs)
    return -sum(p.pc for p in pairs) / sum(p.nc for p in pairs) * len(pairs)


BATCH = {"aot": _aot_batch, "aot_unpaired": _aot_unpaired_batch, "sft": _sft_batch, "orpo": _orpo_batch}
"""Objectives whose summed loss depends on the whole batch: the formula gives the batch sum."""


def _inputs(n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logps = [(-50 * torch.rand(n, generator=gen, dtype=torch.float64) - 0.5).requires_grad_(True) for _ in range(4)]
    nc = torch.randint(1, 40, (n,), generator=gen).to(torch.float64)
    nr = torch.randint(1, 40, (n,), generator=gen).to(torch.float64)
    return logps, nc, nr


def _prompts(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen-prompt log-prob sums and token counts (ORPO's NLL; constants, as the prompt is not trained on here)."""
    gen = torch.Generator().manual_seed(n)
    return -20 * torch.rand(n, generator=gen, dtype=torch.float64) - 1, torch.randint(
        1, 30, (n,), generator=gen
    ).double()


def _logps(tensors, nc, nr) -> PairLogps:
    pp, npp = _prompts(len(nc))
    return PairLogps(*tensors, nc, nr, chosen_prompt_logps=pp, chosen_prompt_token_counts=npp)


def _pairs(tensors, nc, nr, **hyper) -> list[Pair]:
    values = [[float(v) for v in t.detach()] for t in tensors]
    pp, npp = _prompts(len(nc))
    return [
        Pair(*(v[i] for v in values), float(nc[i]), float(nr[i]), **hyper, pp=float(pp[i]), npp=float(npp[i]))
        for i in range(len(nc))
    ]


def _hyper(name: str, beta: float, eps: float) -> dict:
    return {"b": beta, "eps": eps if OBJECTIVES[name].label_smoothing != "none" else 0.0, "delta": 0.3}


CASES = [(0.1, 0.0), (0.5, 0.2), (2.0, 0.0)]


def test_every_objective_has_a_formula():
    assert set(PER_PAIR) | set(BATCH) == set(LOSS_FUNCTIONS)


def _check_gradients(name, tensors, nc, nr, hyper, batch_value) -> None:
    """Autograd of the summed implementation vs central differences of the independent batch formula, w.r.t. the
    policy log-probs (the reference's are constants in training)."""
    step = 1e-6
    for which, tensor in enumerate(tensors[:2]):
        for i in (0, len(nc) // 2, len(nc) - 1):
            shifted = []
            for sign in (1, -1):
                moved = [t.detach().clone() for t in tensors]
                moved[which][i] += sign * step
                shifted.append(batch_value(_pairs(moved, nc, nr, **hyper)))
            numeric = (shifted[0] - shifted[1]) / (2 * step)
            analytic = 0.0 if tensor.grad is None else float(tensor.grad[i])  # None: no dependence at all
            assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-6), (name, which, i)


@pytest.mark.parametrize("loss_type", sorted(LOSS_FUNCTIONS))
@pytest.mark.parametrize("beta,eps", CASES)
def test_loss_matches_float64_formula_values_and_gradients(loss_type, beta, eps):
    if OBJECTIVES[loss_type].label_smoothing == "required" and eps == 0:
        eps = 1e-3  # EXO needs eps > 0 (the paper's value)
    n = 16
    tensors, nc, nr = _inputs(n, seed=7)
    hyper = _hyper(loss_type, beta, eps)
    params = LossParams(beta=beta, label_smoothing=hyper["eps"], nll_weight=0.7)
    context = StepContext(bco_delta=0.3)
    losses = LOSS_FUNCTIONS[loss_type](_logps(tensors, nc, nr), params, context)
    assert losses.shape == (n,) and losses.dtype == torch.float64
    pairs = _pairs(tensors, nc, nr, **hyper)
    if loss_type in PER_PAIR:
        expected = torch.tensor([PER_PAIR[loss_type](p) for p in pairs], dtype=torch.float64)
        torch.testing.assert_close(losses.detach(), expected, rtol=1e-10, atol=1e-10)

        def batch_value(ps):
            return sum(PER_PAIR[loss_type](p) for p in ps)
    else:
        batch_value = BATCH[loss_type]
    assert float(losses.detach().sum()) == pytest.approx(batch_value(pairs), rel=1e-10, abs=1e-10)
    losses.sum().backward()
    _check_gradients(loss_type, tensors, nc, nr, hyper, batch_value)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_aot_with_a_step_context_equals_the_sort_over_the_whole_step(loss_type):
    """Two micro-batches with the step's sort-matched partners sum to the formula over the union of the pairs."""
    from pair_dpo_trainer.losses.aot import sort_matched
    from pair_dpo_trainer.losses.base import AotMatch

    tensors, nc, nr = _inputs(12, seed=3)
    params = LossParams(beta=0.5, label_smoothing=0.1)
    full = PairLogps(*tensors, nc, nr)
    margins = full.policy_chosen_logps - full.policy_rejected_logps
    ref_margins = full.ref_chosen_logps - full.ref_rejected_logps
    uw, ul = full.chosen_logratios(), full.rejected_logratios()
    partners = [sort_matched(margins, ref_margins), sort_matched(uw, ul), sort_matched(ul, uw)]
    total = 0.0
    for part in (slice(0, 5), slice(5, 12)):
        pieces = [t[part] for t in tensors]
        context = StepContext(aot=AotMatch(*(p[part] for p in partners)))
        total = total + LOSS_FUNCTIONS[loss_type](PairLogps(*pieces, nc[part], nr[part]), params, context).sum()
    expected = BATCH[loss_type](_pairs(tensors, nc, nr, b=0.5, eps=0.1))
    assert float(total.detach()) == pytest.approx(expected, rel=1e-12)
    total.backward()
    _check_gradients(loss_type, tensors, nc, nr, {"b": 0.5, "eps": 0.1}, BATCH[loss_type])


def test_sft_with_a_step_context_is_the_token_mean_of_the_step():
    tensors, nc, nr = _inputs(10, seed=4)
    per_pair = nc.sum() / 10
    losses = LOSS_FUNCTIONS["sft"](
        PairLogps(*tensors, nc, nr), LossParams(), StepContext(chosen_tokens_per_pair=per_pair)
    )
    assert float(losses.detach().mean()) == pytest.approx(-float(tensors[0].detach().sum() / nc.sum()), rel=1e-12)


def _f_prime(kind: str, u: float, coef: float) -> float:
    """f'(t) at t = exp(u) (Wang et al. 2023, Table 1; alpha in TRL's parameterisation)."""
    t = math.exp(u)
    if kind == "reverse_kl":
        return math.log(t)
    if kind == "forward_kl":
        return 1 - 1 / t
    if kind == "js_divergence":
        return math.log(2 * t / (1 + t))
    return (t ** (coef - 1) - 1) / (coef - 1)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "discopop"])
def test_f_divergence_replaces_the_log_ratio_by_f_prime(kind, loss_type):
    gen = torch.Generator().manual_seed(11)
    tensors = [(-3 * torch.rand(8, generator=gen, dtype=torch.float64)).requires_grad_(True) for _ in range(4)]
    nc = nr = torch.full((8,), 3.0, dtype=torch.float64)
    params = LossParams(beta=0.4, f_divergence_type=kind, f_alpha_divergence_coef=0.3)
    losses = LOSS_FUNCTIONS[loss_type](PairLogps(*tensors, nc, nr), params)
    for i, p in enumerate(_pairs(tensors, nc, nr, b=0.4)):
        fw, fl = _f_prime(kind, p.uw, 0.3), _f_prime(kind, p.ul, 0.3)
        # the formula with u_w, u_l replaced by f'(exp u_w), f'(exp u_l); rc = rr = 0 keeps the policy terms
        q = Pair(fw, fl, 0.0, 0.0, p.nc, p.nr, b=0.4)
        assert float(losses[i]) == pytest.approx(PER_PAIR[loss_type](q), rel=1e-10, abs=1e-12)


def test_mixture_is_the_weighted_sum_and_wpo_weights_multiply_every_component():
    tensors, nc, nr = _inputs(6, seed=5)
    gen = torch.Generator().manual_seed(1)
    wpo_c, wpo_r = (-torch.rand(6, generator=gen, dtype=torch.float64) * nc, -torch.rand(6, generator=gen) * nr)
    logps = PairLogps(*tensors, nc, nr, chosen_wpo_logps=wpo_c, rejected_wpo_logps=wpo_r.double())
    params = LossParams(beta=0.2)
    out = Objective(["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], params, use_weighting=True)(logps)
    pairs = _pairs(tensors, nc, nr, b=0.2)
    sft = [-p.pc / (float(nc.sum()) / 6) for p in pairs]
    for i, p in enumerate(pairs):
        # WPO (Zhou et al. 2024): w = exp(mean_t(log p_t - log sum_v p_v^2)) for each completion, multiplied
        w = math.exp(float(wpo_c[i]) / p.nc) * math.exp(float(wpo_r[i]) / p.nr)
        expected = w * (0.8 * PER_PAIR["sigmoid"](p) + 0.2 * PER_PAIR["bco_pair"](p) + 1.0 * sft[i])
        assert float(out.losses[i]) == pytest.approx(expected, rel=1e-10)
        assert float(out.components["sigmoid"][i]) == pytest.approx(w * PER_PAIR["sigmoid"](p), rel=1e-10)


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
    assert float(pair.logratio_margins()) == pytest.approx(1.5)


def test_nll_terms_use_the_plain_sums_when_ld_alpha_weights_the_log_probs():
    """LD-DPO weights the preference terms' log-probs; NLL terms (sft, sigmoid_nll, orpo) keep the real NLL."""
    tensors, nc, nr = _inputs(4, seed=9)
    plain = tensors[0].detach() - 7.0
    weighted = PairLogps(*tensors, nc, nr, policy_chosen_nll_logps=plain)
    unweighted = PairLogps(plain, *tensors[1:], nc, nr)
    sft = LOSS_FUNCTIONS["sft"]
    torch.testing.assert_close(sft(weighted, LossParams()), sft(unweighted, LossParams()))
    pp, npp = _prompts(4)
    prompts = {"chosen_prompt_logps": pp, "chosen_prompt_token_counts": npp}
    orpo = LOSS_FUNCTIONS["orpo"]
    weighted_nll = orpo(PairLogps(plain, *tensors[1:], nc, nr, **prompts), LossParams()) - orpo(
        PairLogps(*tensors, nc, nr, policy_chosen_nll_logps=plain, **prompts), LossParams()
    )
    assert float(weighted_nll.abs().max()) > 0  # the odds ratio reads the LD-weighted sums ...
    nll_only = LossParams(beta=0.0)  # ... the NLL the plain ones
    torch.testing.assert_close(
        orpo(PairLogps(*tensors, nc, nr, policy_chosen_nll_logps=plain, **prompts), nll_only),
        orpo(PairLogps(plain, *tensors[1:], nc, nr, **prompts), nll_only),
    )


def test_orpo_needs_the_chosen_prompts_and_pools_its_nll_over_the_step():
    tensors, nc, nr = _inputs(8, seed=5)
    with pytest.raises(ValueError, match="prompts"):
        LOSS_FUNCTIONS["orpo"](PairLogps(*tensors, nc, nr), LossParams())
    pp, npp = _prompts(8)
    logps = PairLogps(*tensors, nc, nr, chosen_prompt_logps=pp, chosen_prompt_token_counts=npp)
    per_pair = (nc + npp).sum() / 8
    zero_lambda = LossParams(beta=0.0)
    step = LOSS_FUNCTIONS["orpo"](logps, zero_lambda, StepContext(chosen_sequence_tokens_per_pair=per_pair))
    alone = LOSS_FUNCTIONS["orpo"](logps, zero_lambda)
    expected = -float((tensors[0].detach() + pp).sum() / (nc + npp).sum())
    assert float(step.detach().mean()) == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(step, alone)


_SYNC_METHODS = ("item", "cpu", "tolist", "nonzero", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("loss_type", sorted(LOSS_FUNCTIONS))
def test_objective_and_metrics_of_a_micro_batch_make_no_host_sync(loss_type, monkeypatch):
    """The loss half of the hot path (objective with WPO, BCO's pending sums, the eval step context, the metric
    sums) calls nothing that waits for the device; the log-prob half is tests/test_logprobs.py's."""
    from pair_dpo_trainer.observability.metrics import PairMetrics
    from pair_dpo_trainer.training.objective_state import RunningRewardMean
    from pair_dpo_trainer.training.step_context import StepContextBuilder

    tensors, nc, nr = _inputs(6, seed=12)
    gen = torch.Generator().manual_seed(2)
    wpo = [-torch.rand(6, generator=gen, dtype=torch.float64) * n for n in (nc, nr)]
    pp, npp = _prompts(6)
    logps = PairLogps(
        *tensors,
        nc,
        nr,
        policy_chosen_nll_logps=tensors[0] - 1.0,
        chosen_wpo_logps=wpo[0],
        rejected_wpo_logps=wpo[1],
        chosen_prompt_logps=pp,
        chosen_prompt_token_counts=npp,
    )
    eps = 1e-3 if OBJECTIVES[loss_type].label_smoothing != "none" else 0.0
    weighting = not OBJECTIVES[loss_type].sorts_step  # WPO is refused for AOT (config)
    objective = Objective([loss_type, "sft"], [1.0, 0.5], LossParams(label_smoothing=eps), use_weighting=weighting)
    state = RunningRewardMean(torch.device("cpu"))
    contexts = StepContextBuilder(objective, state)
    metrics = PairMetrics(objective.names)
    token_stats = torch.rand(12, 4, generator=gen, dtype=torch.float64)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync in the objective / metrics hot path")

    for name in _SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    output = objective(logps, contexts.for_microbatch(logps, torch.ones(6, dtype=torch.float64)))
    state.observe(logps, 0.1)
    metrics.update(logps, output.losses, 0.1, num_tokens=123, components=output.components, token_stats=token_stats)
    output.losses.sum().backward()
    monkeypatch.undo()
    assert output.losses.shape == (6,) and bool(torch.isfinite(output.losses).all())
    assert metrics.reduce(torch.device("cpu"))["loss"] == pytest.approx(float(output.losses.mean()), rel=1e-12)
