"""Float8 training, activation checkpointing (full / every K-th layer / selective / auto) and host offload, on the
CPU: what each converts or checkpoints, that gradients are unchanged by checkpointing, what it saves, and the option
checks. The GPU speed and memory of the same options are in docs/benchmarks.md."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.config.sections import BatchLimits, LayerOptions
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.checkpointing import apply_activation_checkpointing, offload_activations
from pair_dpo_trainer.modeling.compile import compile_decoder_layers
from pair_dpo_trainer.training.checks import run_problems
from pair_dpo_trainer.training.memory_fit import MemoryFit, choose_checkpointing, most_conservative
from tests.dpo_fixtures import cpu_config, run_setup, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer

torchao = pytest.importorskip("torchao.float8", reason="fp8 needs torchao (the test extra installs it)")


def _trainer(tmp_path, **options) -> PairDPOTrainer:
    args = cpu_config(tmp_path, **options)
    return PairDPOTrainer(
        model=tiny_llama(0), args=args, train_dataset=synthetic_pairs(16), processing_class=tiny_tokenizer()
    )


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward during one training forward (parameters excluded), and the gradients."""
    params = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.data_ptr() not in params:
            total += tensor.numel() * tensor.element_size()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, use_cache=False).logits.square().mean()
    loss.backward()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------ checkpointing


@pytest.mark.parametrize("mode", ["full", "selective", "layers:2"])
def test_checkpointing_keeps_the_gradients_and_saves_less(mode):
    torch.manual_seed(0)
    base = tiny_llama(0)
    ids = torch.randint(4, 64, (1, 96))
    plain_bytes, plain_grads = _saved_bytes(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode)
    saved, grads = _saved_bytes(model, ids)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    assert saved < plain_bytes, (mode, saved, plain_bytes)
    if mode == "full":
        full_saved = saved
        assert full_saved < 0.5 * plain_bytes
    names_before = [n for n, _ in base.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names_before  # checkpoints and optimizers see the same names


def test_every_k_layers_checkpoints_the_layers_at_multiples_of_k_and_off_undoes_it():
    model = tiny_llama(0)
    assert apply_activation_checkpointing(model, "layers:2") == 1  # 2 layers: layer 0 only
    assert [layer._pair_dpo_checkpoint for layer in model.model.layers] == [True, False]
    assert apply_activation_checkpointing(model, "off") == 0
    assert not any(layer._pair_dpo_checkpoint for layer in model.model.layers)


@pytest.mark.integration
def test_checkpointing_does_nothing_without_gradients_and_compiles_with_the_layer():
    torch.manual_seed(0)
    base = tiny_llama(0)
    ids = torch.randint(4, 64, (1, 40))
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, "selective")
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", dynamic=True, fullgraph=True)  # no graph break in the wrapped layer
    _, grads = _saved_bytes(model, ids)
    _, expected = _saved_bytes(copy.deepcopy(base), ids)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, base(ids, use_cache=False).logits)


def test_offload_keeps_no_saved_activation_on_the_model_device_and_the_same_gradients():
    torch.manual_seed(0)
    base = tiny_llama(0)
    ids = torch.randint(4, 64, (1, 64))
    _, expected = _saved_bytes(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, "full")
    offload_activations(model)
    offload_activations(model)  # idempotent
    model.train()
    loss = model(ids, use_cache=False).logits.square().mean()
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------------------ auto


class _Meter:
    """Peak = bytes the probe saves for backward, as checkpointing changes them (a real, host-side measurement)."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, limit: int) -> None:
        self.model, self.ids, self._limit, self.last = model, ids, limit, 0
        self.tried: list[int] = []

    def reset(self) -> None:
        self.last = 0

    def peak(self) -> int:
        self.tried.append(self.last)
        return self.last

    def limit(self) -> int:
        return self._limit

    def probe(self) -> None:
        self.last, _ = _saved_bytes(self.model, self.ids)


def test_auto_keeps_the_cheapest_mode_whose_measured_peak_fits():
    torch.manual_seed(0)
    model = tiny_llama(0)
    ids = torch.randint(4, 64, (1, 96))
    plain, _ = _saved_bytes(copy.deepcopy(model), ids)
    roomy = _Meter(model, ids, limit=10 * plain)
    fit = choose_checkpointing(model, roomy.probe, roomy, pending_bytes=0, tokens=96)
    assert fit.mode == "off" and fit.fits and len(roomy.tried) == 1
    tight = _Meter(model, ids, limit=plain - 1)  # "off" does not fit, something cheaper than full does
    fit = choose_checkpointing(model, tight.probe, tight, pending_bytes=0, tokens=96)
    assert fit.mode == "selective" and fit.fits and tight.tried[0] == plain and tight.tried[1] < plain
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind
    hopeless = _Meter(model, ids, limit=1)
    fit = choose_checkpointing(model, hopeless.probe, hopeless, pending_bytes=0, tokens=96)
    assert fit.mode == "full+offload+tiled" and not fit.fits and "does not fit" in fit.describe()
    assert model.model.layers[1]._pair_dpo_checkpoint  # left marked with the choice
    assert model.model._pair_dpo_offload_on and model.model.layers[1].mlp._pair_dpo_mlp_tile == "auto"


class _InjectedMeter:
    """Peaks given per candidate (the GPU measurement stands apart); records what each probe ran: the checkpointed
    layers, host offload and the MLP tiles as the model was marked, read from the model during the real probe."""

    def __init__(self, model: torch.nn.Module, peaks: dict[str, int], limit: int) -> None:
        self.model, self.peaks, self._limit = model, peaks, limit
        self.ran: list[tuple[int, bool, object]] = []

    def reset(self) -> None:
        pass

    def probe(self) -> None:
        layers = self.model.model.layers
        marked = (sum(layer._pair_dpo_checkpoint for layer in layers), self.model.model._pair_dpo_offload_on)
        self.ran.append((*marked, layers[0].mlp._pair_dpo_mlp_tile))
        _saved_bytes(self.model, torch.randint(4, 64, (1, 40)))  # a real forward and backward as marked

    def peak(self) -> int:
        return list(self.peaks.values())[len(self.ran) - 1]

    def limit(self) -> int:
        return self._limit


PEAKS = {"off": 100, "selective": 90, "layers:4": 88, "layers:3": 86, "layers:2": 80, "full": 70,
         "full+offload": 55, "full+offload+tiled": 35}  # fmt: skip


@pytest.mark.parametrize(
    "limit,choice,marks",
    [
        (75, "full", (2, False, None)),
        (60, "full+offload", (2, True, None)),
        (40, "full+offload+tiled", (2, True, "auto")),
    ],
)
def test_auto_adds_offload_then_tiles_when_full_checkpointing_does_not_fit(limit, choice, marks):
    """Beyond ``full``: the layer inputs in host memory, then also the MLP in tiles; the first that fits is kept, the
    model left marked with it, and the summary names it."""
    from pair_dpo_trainer.training.memory_fit import CANDIDATES

    assert tuple(PEAKS) == CANDIDATES
    model = tiny_llama(0)
    meter = _InjectedMeter(model, PEAKS, limit)
    fit = choose_checkpointing(model, meter.probe, meter, pending_bytes=5, tokens=40)
    assert fit.mode == choice and fit.fits and fit.peak_bytes == PEAKS[choice] + 5
    assert meter.ran[-1] == marks and len(meter.ran) == CANDIDATES.index(choice) + 1
    assert meter.ran[0] == (0, False, None) and meter.ran[1][:2] == (2, False)  # off, then selective (every layer)
    assert f"auto -> {choice} (" in fit.describe()
    layers = model.model.layers  # left marked with the choice
    left = (sum(layer._pair_dpo_checkpoint for layer in layers), model.model._pair_dpo_offload_on, layers[1].mlp)
    assert left[:2] == marks[:2] and left[2]._pair_dpo_mlp_tile == marks[2]


def test_auto_keeps_the_configured_tiles_and_offload_in_every_candidate():
    from pair_dpo_trainer.training.memory_fit import Strategy

    model = tiny_llama(0)
    meter = _InjectedMeter(model, PEAKS, limit=60)
    fit = choose_checkpointing(
        model, meter.probe, meter, pending_bytes=0, tokens=40, kept=Strategy("auto", offload=True, tiled_mlp=16)
    )
    assert fit.mode == "full+offload"
    assert all(offload and tiles == 16 for _, offload, tiles in meter.ran)


@pytest.mark.integration
@pytest.mark.parametrize("room", ["compiled_off_fits", "only_the_eager_choice_fits"])
def test_auto_under_compile_measures_the_cheaper_modes_again_through_the_compiled_layers(tmp_path, monkeypatch, room):
    """The eager probe rejects "off"; once the layers are compiled they save less (inductor's partitioner), so
    "off" is measured again and kept when its compiled peak fits, else the eager choice stays."""
    from pair_dpo_trainer.training import layers as training_layers

    torch.manual_seed(0)
    ids = torch.randint(4, 64, (1, 96))
    eager_off, _ = _saved_bytes(tiny_llama(0), ids)
    compiled = tiny_llama(0)
    compile_decoder_layers(compiled, backend="aot_eager")
    compiled_off, _ = _saved_bytes(compiled, ids)
    assert compiled_off < eager_off  # what the re-measurement is for
    limit = (compiled_off + eager_off) // 2 if room == "compiled_off_fits" else compiled_off - 1
    model = tiny_llama(0)
    meter = _Meter(model, ids, limit=limit)
    monkeypatch.setattr(training_layers, "CudaPeakMeter", lambda _device: meter)
    args = cpu_config(
        tmp_path,
        activation_checkpointing_mode="auto",
        max_tokens_per_microbatch=96,
        gradient_accumulation_steps=1,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    monkeypatch.setattr(training_layers, "optimizer_state_bytes", lambda _model: 0)
    budget = training_layers.Budget(args.max_tokens_per_microbatch, args.device, args.world_size)
    layers = LayerOptions.from_config(args)
    plan = training_layers.prepare_layers(model, None, layers, probe=meter.probe, training=True, budget=budget)
    assert meter.tried[0] == eager_off > limit  # eager "off" rejected, then the eager choice ...
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers)
    if room == "compiled_off_fits":
        assert meter.tried[-1] == compiled_off  # ... and "off" again, through the compiled layers
        assert plan.checkpointing == "off" and plan.fit.compiled and plan.fit.fits
        assert "auto -> off" in plan.describe() and "compiled layers" in plan.describe()
        assert not any(layer._pair_dpo_checkpoint for layer in model.model.layers)
    else:
        assert meter.tried[-1] == compiled_off and plan.checkpointing == "selective" and not plan.fit.compiled
        assert all(layer._pair_dpo_checkpoint for layer in model.model.layers)  # left marked with the choice
    assert all(p.grad is None for p in model.parameters())


def test_the_budget_probe_runs_the_policy_forward_under_the_training_autocast(tmp_path):
    """A prepared policy's forward runs under accelerate's autocast, so the probe's does too: Dynamo compiles a layer
    again for another autocast state, and auto would otherwise measure (and compile) a graph training never runs."""
    from pair_dpo_trainer.modeling import enable_pair_varlen
    from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
    from pair_dpo_trainer.training.layers import budget_probe

    policy, reference = tiny_llama(0), tiny_llama(0)
    for model in (policy, reference):
        enable_pair_varlen(model, "sdpa_segments")
    seen = []
    for layer in (*policy.model.layers, *reference.model.layers):
        layer.register_forward_hook(lambda module, *_: seen.append((module, torch.is_autocast_enabled("cpu"))))
    args = cpu_config(
        tmp_path, max_tokens_per_microbatch=96, max_length=64, max_prompt_length=32, gradient_accumulation_steps=1
    )
    probe = budget_probe(
        policy,
        lambda batch: packed_sequence_logps(reference, batch),
        PackedPairCollator(),
        BatchLimits.from_config(args),
        vocab_size=policy.config.vocab_size,
        device=args.device,
        chunk_size=args.logps_chunk_size,
        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    )
    probe()
    policy_layers = set(policy.model.layers)
    assert [on for module, on in seen if module in policy_layers] == [True, True]
    assert [on for module, on in seen if module not in policy_layers] == [False, False]  # the reference: no autocast
    assert "forward" not in policy.__dict__ and not torch.is_autocast_enabled("cpu")  # the policy's own forward again
    assert policy.model.layers[0].mlp.down_proj.weight.grad is not None


def test_ranks_agree_on_the_most_recompute_and_the_summary_names_the_choice():
    assert most_conservative(["off", "layers:2", "selective"]) == "layers:2"
    fit = MemoryFit("layers:2", 101 * 2**30, 125 * 2**30, True, 16384)
    assert fit.describe() == "auto -> layers:2 (peak 101.0 of 125.0 GiB at 16384 tokens)"
    assert math.isfinite(fit.peak_bytes)


# ------------------------------------------------------------------------------------------------ float8


def test_fp8_converts_only_the_decoder_linears_and_keeps_names_and_parameters():
    from pair_dpo_trainer.modeling.float8 import convert_to_fp8, count_fp8_layers

    model = tiny_llama(0)
    params = dict(model.named_parameters())
    converted = convert_to_fp8(model, "tensorwise")
    assert converted == count_fp8_layers(model) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(model.get_parameter(name) is param for name, param in params.items())  # the same objects
    assert convert_to_fp8(model, "tensorwise") == 0  # idempotent


@pytest.mark.integration
def test_fp8_trainer_pads_rows_to_16_starts_at_ln2_and_trains(tmp_path):
    trainer = _trainer(tmp_path / "a", fp8="tensorwise", max_steps=2, gradient_accumulation_steps=1)
    assert isinstance(trainer.data_collator, PackedPairCollator) and trainer.data_collator.pad_to_multiple_of == 16
    pairs = synthetic_pairs(3)
    batch = trainer.data_collator(pairs)
    prompts = sum(len(p["prompt_input_ids"]) for p in pairs)
    real = prompts + sum(len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in pairs)  # prompts once
    assert trainer.share_prompt and batch.num_unshared_tokens == real + prompts
    assert batch.num_tokens % 16 == 0 and batch.num_real_tokens == real < batch.num_tokens + 16
    result = trainer.train()
    assert trainer.layer_plan is not None and trainer.layer_plan.fp8_layers == 14
    reference = trainer.reference_manager.reference.model
    assert sum(type(m).__name__ == "Float8Linear" for m in reference.modules()) == 14  # the same recipe
    first = trainer.state.log_history[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy and reference: one computation at step 0
    assert math.isfinite(result.training_loss)


def test_fp8_is_refused_with_deepspeed_and_a_peft_policy_and_a_bad_recipe(tmp_path):
    for setup, word in (({"deepspeed_config": {"train_batch_size": 1}}, "DeepSpeed"), ({"peft_policy": True}, "PEFT")):
        problems = run_problems(cpu_config(tmp_path, fp8="rowwise"), run_setup(**setup))
        assert any(code == "unsupported_combination" and word in text for code, text in problems), problems
    with pytest.raises(ConfigError) as info:
        cpu_config(tmp_path, fp8="e4m3")
    assert info.value.reason_code == "bad_fp8"


def test_checkpointing_options_are_checked(tmp_path):
    with pytest.raises(ConfigError) as info:
        cpu_config(tmp_path, activation_checkpointing_mode="layers:1")
    assert info.value.reason_code == "bad_activation_checkpointing"
    with pytest.raises(ConfigError) as info:
        cpu_config(tmp_path, activation_checkpointing_mode="full", gradient_checkpointing=True)
    assert info.value.reason_code == "unsupported_combination" and "twice" in str(info.value)
    with pytest.raises(ConfigError) as info:
        cpu_config(tmp_path, activation_checkpointing_mode="auto")
    assert "max_tokens_per_microbatch" in str(info.value)
    args = cpu_config(
        tmp_path, activation_checkpointing_mode="auto", max_tokens_per_microbatch=256, gradient_accumulation_steps=1
    )
    problems = run_problems(args, run_setup())
    assert any("no CUDA device" in text for _, text in problems)


@pytest.mark.integration
def test_a_checkpointed_trainer_reports_the_mode_and_matches_the_plain_losses(tmp_path, capsys):
    plain = _trainer(tmp_path / "plain", max_steps=2)
    plain.train()
    checked = _trainer(
        tmp_path / "ckpt",
        max_steps=2,
        activation_checkpointing_mode="layers:2",
        activation_offload=True,
        tiled_mlp=5,
    )
    checked.train()
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pair_dpo: world_size=")][-1]
    assert "activation checkpointing layers:2" in line and "offloaded to host memory" in line
    assert "MLP in tiles of 5 tokens" in line
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (plain, checked)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


@pytest.mark.slow  # inductor compiles the float8 layers on the CPU (~40 s)
def test_fp8_compiled_by_inductor_still_starts_at_ln2(tmp_path, monkeypatch):
    """The policy's training graph and the reference's inference graph round the float8 casts alike (without
    inductor's eager-precision casts they differ: 7.5e-5 from ln 2 here, 1.6e-2 on an H200)."""
    from pair_dpo_trainer.testing.cpu_varlen import install_traceable_varlen

    backend = install_traceable_varlen(monkeypatch)
    # the config's own patch: pytest's monkeypatch would delete the option on undo (it reads a ConfigModule's
    # __dict__, where options do not live), breaking every later compile in this process
    with torch._inductor.config.patch(emulate_precision_casts=False):
        _train_fp8_compiled_from_ln2(tmp_path, backend)


def _train_fp8_compiled_from_ln2(tmp_path, backend):
    args = cpu_config(
        tmp_path, max_steps=1, attn_backend=backend, torch_compile=True, fp8="tensorwise", gradient_accumulation_steps=1
    )
    trainer = PairDPOTrainer(
        model=tiny_llama(0).to(torch.bfloat16),
        args=args,
        train_dataset=synthetic_pairs(16),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    first = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    assert first == pytest.approx(math.log(2), abs=1e-6)


def test_prepare_layers_applies_the_auto_choice_to_the_policy_and_the_reference_and_names_it(tmp_path, monkeypatch):
    """Through ``prepare_layers`` (the meter injected): the policy is left checkpointed, offloaded and tiled, the
    in-process reference's MLP runs in the same tiles, and the run summary's layer part names the choice."""
    from pair_dpo_trainer.training import layers as training_layers

    policy, reference = tiny_llama(0), tiny_llama(1)
    meter = _InjectedMeter(policy, PEAKS, limit=40)
    monkeypatch.setattr(training_layers, "CudaPeakMeter", lambda _device: meter)
    monkeypatch.setattr(training_layers, "optimizer_state_bytes", lambda _model: 0)
    args = cpu_config(
        tmp_path, activation_checkpointing_mode="auto", max_tokens_per_microbatch=64, gradient_accumulation_steps=1
    )
    budget = training_layers.Budget(args.max_tokens_per_microbatch, args.device, args.world_size)
    layers = LayerOptions.from_config(args)
    plan = training_layers.prepare_layers(policy, reference, layers, probe=meter.probe, training=True, budget=budget)
    assert (plan.checkpointing, plan.offload, plan.tiled_mlp) == ("full", True, "auto")
    described = plan.describe()
    assert "auto -> full+offload+tiled (peak" in described and "MLP in tiles of about hidden_size" in described
    assert all(layer.mlp._pair_dpo_mlp_tile == "auto" for layer in reference.model.layers)
    assert policy.model._pair_dpo_offload_on and all(layer._pair_dpo_checkpoint for layer in policy.model.layers)
