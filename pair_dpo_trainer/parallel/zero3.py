"""DeepSpeed ZeRO-3 leaf modules: one parameter gather per decoder layer instead of one per ``Linear``/norm.

ZeRO-3 installs forward and backward hooks on every submodule that owns parameters; each hook call runs
DeepSpeed's fetch/prefetch/release bookkeeping in Python. A Llama layer has ~10 such submodules (4 attention
projections, 3 MLP projections, 2 norms, the rotary embedding), so a 24-layer model makes several hundred hook calls
per forward and as many again in backward. With small per-GPU batches that host work, not the GPU, sets the step
time (measured on 2 GPUs: ``docs/benchmarks.md``, ZeRO-3 sections).

Details: parallel/README.md, "Module notes", ``zero3.py``.
"""

from __future__ import annotations

import re

import torch

from pair_dpo_trainer.errors import ConfigError, Problem
from pair_dpo_trainer.modeling.layers import find_decoder_layers
from pair_dpo_trainer.modeling.wrappers import unwrap_model

LEAF_AUTO = "auto"
LEAF_NONE = "none"
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def zero3_leaf_modules_problem(value: object) -> str | None:
    """Why ``zero3_leaf_modules=value`` is not a valid setting, or None when it is.

    Example:
        >>> zero3_leaf_modules_problem("LlamaDecoderLayer, transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer")
        >>> zero3_leaf_modules_problem("Llama Decoder") is not None
        True
    """
    if isinstance(value, str) and value in (LEAF_AUTO, LEAF_NONE):
        return None
    names = [name.strip() for name in value.split(",")] if isinstance(value, str) else []
    if names and all(_CLASS_NAME.match(name) for name in names):
        return None
    return (
        f"zero3_leaf_modules={value!r}: use 'auto' (each decoder layer is one ZeRO-3 gather), 'none' (DeepSpeed's "
        "per-submodule hooks) or comma-separated module class names, e.g. 'LlamaDecoderLayer'."
    )


def zero3_leaf_problems(value: str, *, zero3: bool, peft: bool) -> list[Problem]:
    """``zero3_leaf_modules`` class names without ZeRO-3 (they would change nothing) or with a PEFT policy (DeepSpeed
    reduces a leaf's gradients before the LoRA weight gradients are accumulated: see the module docstring)."""
    if value in (LEAF_AUTO, LEAF_NONE):
        return []
    if not zero3:
        return [
            (
                "unsupported_combination",
                f"zero3_leaf_modules={value!r} names DeepSpeed ZeRO-3 leaf modules, but this run does not use ZeRO-3: "
                "launch with a ZeRO-3 DeepSpeed config, or leave zero3_leaf_modules at 'auto'.",
            )
        ]
    if peft:
        return [
            (
                "unsupported_combination",
                f"zero3_leaf_modules={value!r} with a PEFT (LoRA) policy: DeepSpeed reduces a leaf module's gradients "
                "before LoRA weight gradients are accumulated, which fails in backward. Leave zero3_leaf_modules at "
                "'auto' (no leaves for a PEFT policy) or set 'none'.",
            )
        ]
    return []


def mark_zero3_leaf_modules(model: torch.nn.Module, value: str) -> tuple[str, ...]:
    """Flags modules of ``model`` as ZeRO-3 leaves; call before the model's DeepSpeed engine is created.

    Args:
        model: The policy or reference model (unwrapped or wrapped, e.g. by PEFT), not yet a DeepSpeed engine.
        value: ``PairDPOConfig.zero3_leaf_modules``: ``"auto"``, ``"none"`` or comma-separated class names.

    Returns:
        The sorted class names of the flagged modules (``()`` for ``"none"``).

    Raises:
        ConfigError: ``zero3_leaf_modules_not_found`` when ``"auto"`` finds no repeated decoder layers, or no
            module of ``model`` has one of the given class names.
    """
    if value == LEAF_NONE:
        return ()
    from deepspeed.utils import set_z3_leaf_modules

    if value == LEAF_AUTO:
        layers = find_decoder_layers(model)
        if layers is None:
            raise ConfigError(
                "zero3_leaf_modules_not_found",
                f"zero3_leaf_modules='auto' makes each decoder layer one ZeRO-3 gather, but "
                f"{type(unwrap_model(model)).__name__} has no repeated decoder layers that pair_dpo_trainer "
                "recognises: name the block class (zero3_leaf_modules='MyBlock') or set zero3_leaf_modules='none'.",
            )
        classes: list[type | str] = [type(layers[0])]
    else:
        classes = [name.strip() for name in value.split(",")]
    try:
        flagged = set_z3_leaf_modules(model, classes)
    except ValueError as error:
        raise ConfigError(
            "zero3_leaf_modules_not_found",
            f"zero3_leaf_modules={value!r}: no module of {type(unwrap_model(model)).__name__} has one of these class "
            "names (a short name like 'LlamaDecoderLayer' or the fully qualified one): fix the names or set 'auto'.",
        ) from error
    return tuple(sorted({type(module).__name__ for module in flagged}))


def zero3_leaf_setup(model: torch.nn.Module, value: str, *, zero3: bool, peft: bool = False) -> tuple[str, ...]:
    """The trainer's entry point: flags the policy's leaves under ZeRO-3; elsewhere only ``"auto"``/``"none"``.

    A PEFT (LoRA) policy gets no leaves: ``"auto"`` means DeepSpeed's per-submodule hooks for it. DeepSpeed reduces a
    leaf's gradients in a full backward hook of the leaf, i.e. as soon as the gradient of the leaf's *input* exists;
    a LoRA weight's gradient can still be pending then, and its later accumulation into the re-partitioned
    (empty) parameter fails (deepspeed 0.19.8, 2 CPU ranks: ``The size of tensor a (0) must match the size of tensor
    b (4)`` in ``AccumulateGrad`` of ``lora_B``). Full-parameter layers, also with some weights frozen, train
    correctly as leaves.

    Args:
        model: The policy, before ``accelerator.prepare``.
        value: ``PairDPOConfig.zero3_leaf_modules``.
        zero3: Whether the run uses DeepSpeed ZeRO-3.
        peft: Whether the policy is a ``peft.PeftModel``.

    Returns:
        The flagged class names (``()`` when nothing is flagged).

    Raises:
        ConfigError: the errors of :func:`mark_zero3_leaf_modules`. Class names without ZeRO-3 (they would change
            nothing) or with a PEFT policy (see above) are refused before, by ``training.checks.zero3_leaf_problems``.
    """
    if not zero3 or peft:
        return ()
    return mark_zero3_leaf_modules(model, value)


def ensure_deepspeed_comm() -> None:
    """Loading the policy by path under ``TrainingArguments(deepspeed=<ZeRO-3 config>)`` runs ``from_pretrained``
    inside ``deepspeed.zero.Init``, whose batch-size check reads ``deepspeed.comm``'s world size; under a plain gloo
    group set up by accelerate (``use_cpu=True``) that reads 1 until ``deepspeed.comm`` is initialised.

    Initialises ``deepspeed.comm`` when a ZeRO-3 load is about to run and it is not initialised; else nothing."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        return
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    ds_comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
