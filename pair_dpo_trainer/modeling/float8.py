"""Float8 training of the decoder layers' ``Linear`` layers with torchao (``fp8="tensorwise" | "rowwise"``).

Only the repeated decoder layers are converted (the LM head and embeddings keep the compute dtype; the chunked head
multiplies ``head.weight`` itself), and only ``Linear`` layers whose both dimensions are multiples of 16 (what
``torch._scaled_mm`` takes). The weight-gradient matmul of a ``Float8Linear`` has the token count as its inner
dimension, so packed rows are padded to :data:`FP8_TOKEN_MULTIPLE` tokens (:func:`fp8_pad_multiple`). Conversion
keeps every parameter object and name, so optimizers, checkpoints and the reference identity are unchanged.

Details: modeling/README.md, "Module notes", ``float8.py``.
"""

from __future__ import annotations

import torch

from pair_dpo_trainer.errors import ConfigError, Problem
from pair_dpo_trainer.modeling.layers import find_decoder_layers

FP8_TOKEN_MULTIPLE = 16
"""``torch._scaled_mm`` needs every inner dimension to be a multiple of 16, the token count included."""


def _torchao_float8():
    """torchao's float8 module, or a ``ConfigError`` saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise ConfigError(
            "fp8_unavailable",
            f"fp8 needs torchao's float8 training (pip install 'torchao>=0.17'): {exc}. Install it or set fp8=None.",
        ) from exc
    return float8


def fp8_problems(fp8: str | None, *, deepspeed: bool, peft: bool, device: torch.device) -> list[Problem]:
    """What this run cannot do with ``fp8`` set (an empty list when it is off or supported).

    Args:
        fp8: The recipe (``PairDPOConfig.fp8``), or None.
        deepspeed: The policy runs under DeepSpeed (ZeRO-3 partitions the weights outside torchao's float8 layers,
            and DeepSpeed's reference engine is built after the policy's layers are converted).
        peft: The policy is a PEFT model (its frozen base layers are wrapped by adapters before conversion could
            see them; the adapters are too small for float8 matmuls to pay off).
        device: The training device (float8 matmuls need a CUDA GPU of compute capability 8.9 or newer, or run as
            real float8 casts on the CPU, slowly).
    """
    if fp8 is None:
        return []
    problems: list[Problem] = []
    if deepspeed:
        problems.append(
            (
                "unsupported_combination",
                f"fp8={fp8!r} with DeepSpeed: ZeRO-3 partitions the Linear weights outside torchao's float8 layers "
                "(there is no float8 all-gather for ZeRO-3), and the reference engine would not run the policy's "
                "recipe. Use FSDP2 (accelerate_configs/fsdp2.yaml) or DDP for float8, or set fp8=None.",
            )
        )
    if peft:
        problems.append(
            (
                "unsupported_combination",
                f"fp8={fp8!r} with a PEFT (LoRA) policy: the frozen base layers sit inside the adapters' wrappers and "
                "the trainable matmuls are too small for float8 to pay off. Set fp8=None for LoRA.",
            )
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        problems.append(
            (
                "unsupported_combination",
                f"fp8={fp8!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); this one is "
                f"{capability}: set fp8=None.",
            )
        )
    return problems


def _keep(module: torch.nn.Module, converted: type) -> bool:
    return (
        isinstance(module, torch.nn.Linear)
        and not isinstance(module, converted)
        and module.in_features % FP8_TOKEN_MULTIPLE == 0
        and module.out_features % FP8_TOKEN_MULTIPLE == 0
    )


def convert_to_fp8(model: torch.nn.Module, recipe: str, *, fsdp_float8_all_gather: bool = False) -> int:
    """Swaps the eligible ``Linear`` layers of ``model``'s decoder layers for torchao ``Float8Linear`` in place.

    Idempotent (already converted layers are skipped). Call it before the layers are compiled and before FSDP2
    shards them.

    Args:
        model: A transformers causal LM (or a wrapper around one).
        recipe: ``"tensorwise"`` or ``"rowwise"`` (torchao's recipe names).
        fsdp_float8_all_gather: FSDP2 all-gathers the converted weights in float8 (tensorwise only).

    Returns:
        The number of layers converted now.

    Raises:
        ConfigError: ``fp8_unavailable`` without torchao; ``compile_unsupported`` for a model without
            recognisable decoder layers.
    """
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    layers = find_decoder_layers(model)
    if layers is None:
        raise ConfigError(
            "compile_unsupported",
            f"fp8={recipe!r} converts the repeated decoder layers, but {type(model).__name__} has none that "
            "pair_dpo_trainer recognises: set fp8=None.",
        )
    from torchao.float8.float8_linear import Float8Linear

    before = count_fp8_layers(model)
    for layer in layers:
        float8.convert_to_float8_training(
            layer, config=config, module_filter_fn=lambda module, _fqn: _keep(module, Float8Linear)
        )
    return count_fp8_layers(model) - before


def count_fp8_layers(model: torch.nn.Module) -> int:
    """The ``Float8Linear`` layers inside ``model`` (0 without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return 0
    return sum(isinstance(module, Float8Linear) for module in model.modules())


def fp8_pad_multiple(fp8: str | None) -> int | None:
    """The packed-row length multiple ``fp8`` needs (None when it is off)."""
    return None if fp8 is None else FP8_TOKEN_MULTIPLE


def precompute_fp8_scales(model: torch.nn.Module) -> None:
    """FSDP2 with float8 all-gather: every converted weight's scale for the next step's all-gather in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); a no-op for unsharded weights."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
