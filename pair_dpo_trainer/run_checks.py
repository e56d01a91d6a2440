"""The one point where option combinations that need the runtime are checked, all of them, raised once.

:class:`~pair_dpo_trainer.config.PairDPOConfig` checks every option that needs only the config (``__post_init__``).
What needs the run itself (the DeepSpeed configuration, the FSDP2 plugin, the process group, whether the policy is a
PEFT model, whether a ``ref_model`` was passed, the resolved attention kernel) is checked here, by
:func:`run_problems`, which ``PairDPOTrainer.create_accelerator_and_postprocess`` calls right after the Accelerator
exists (before Accelerate, the Trainer or the reference use any of it). Both raise through :func:`raise_problems`:
one :class:`~pair_dpo_trainer.errors.ConfigError` whose ``.problems`` lists every ``(reason_code, message)``.

The rules themselves stay with the module that owns the feature (``reference.fsdp.fsdp_reference_problems``,
``reference.engine.reference_zero_stage_problems``, ``modeling.fsdp2.fsdp2_problems``, ...); this module only collects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pair_dpo_trainer.errors import ConfigError, Problem

if TYPE_CHECKING:
    from pair_dpo_trainer.config import PairDPOConfig


@dataclass(frozen=True)
class RunSetup:
    """What the runtime checks read besides the config.

    Attributes:
        deepspeed_config: The run's DeepSpeed configuration (None without DeepSpeed).
        fsdp_plugin: The run's FSDP2 plugin (None without FSDP), not yet installed.
        process_group: Whether ``torch.distributed`` is initialised.
        peft_policy: Whether the policy is a ``peft.PeftModel``.
        ref_model_given: Whether the user passed ``ref_model``.
        attn_backend: The attention kernel ``enable_pair_varlen`` resolved (``"sdpa_segments"``, ...).
        zero3: Whether the policy runs under DeepSpeed ZeRO stage 3.
    """

    deepspeed_config: Mapping[str, Any] | None
    fsdp_plugin: Any
    process_group: bool
    peft_policy: bool
    ref_model_given: bool
    attn_backend: str
    zero3: bool

    def adapter_disabled_reference(self, args: PairDPOConfig) -> bool:
        """Whether the reference is the PEFT policy with its adapters disabled (no separate model)."""
        return args.uses_reference and not self.ref_model_given and not args.ref_model_name_or_path and self.peft_policy


def raise_problems(problems: Sequence[Problem], *, what: str | None = None) -> None:
    """Raises one ``ConfigError`` listing every problem (nothing when there is none).

    Args:
        problems: ``(reason_code, message)`` pairs.
        what: Names the object in a summary line (``"PairDPOConfig"``: ``"PairDPOConfig has 2 invalid
            option(s): ..."``); None raises a single problem with its own message.

    Raises:
        ConfigError: the problem's own code when there is one, ``invalid_config`` for several; ``.problems`` lists
            them all.

    Example:
        >>> raise_problems([])
        >>> try:
        ...     raise_problems([("bad_beta", "beta=0: set beta > 0."), ("bad_length", "max_length=1: set > 1.")])
        ... except ConfigError as error:
        ...     print(error.reason_code, [code for code, _ in error.problems])
        invalid_config ['bad_beta', 'bad_length']
    """
    if not problems:
        return
    code = problems[0][0] if len(problems) == 1 else "invalid_config"
    if what is None and len(problems) == 1:
        message = problems[0][1]
    else:
        lines = "\n".join(f"  - [{c}] {text}" for c, text in problems)
        message = f"{what or 'this run'} has {len(problems)} invalid option(s):\n{lines}"
    raise ConfigError(code, message, problems=list(problems))


def run_problems(args: PairDPOConfig, setup: RunSetup) -> list[Problem]:
    """Every ``(reason_code, message)`` for option combinations this run's runtime does not support."""
    problems: list[Problem] = []
    if setup.fsdp_plugin is not None:
        from pair_dpo_trainer.modeling.fsdp2 import fsdp2_problems

        problems.extend(fsdp2_problems(setup.fsdp_plugin, args))
        if not setup.process_group:
            problems.append(
                ("unsupported_combination", "FSDP2 needs a process group: launch with accelerate or torchrun.")
            )
    problems.extend(zero3_leaf_problems(args.zero3_leaf_modules, zero3=setup.zero3, peft=setup.peft_policy))
    problems.extend(reference_problems(args, setup))
    problems.extend(compile_problems(args, setup))
    return problems


def zero3_leaf_problems(value: str, *, zero3: bool, peft: bool) -> list[Problem]:
    """``zero3_leaf_modules`` class names without ZeRO-3 (they would change nothing) or with a PEFT policy (DeepSpeed
    reduces a leaf's gradients before the LoRA weight gradients are accumulated: see ``modeling.zero3``)."""
    from pair_dpo_trainer.modeling.zero3 import LEAF_AUTO, LEAF_NONE

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


def reference_problems(args: PairDPOConfig, setup: RunSetup) -> list[Problem]:
    """The reference options that do not fit this run (what ``reference.build`` would otherwise ignore or fail on)."""
    from pair_dpo_trainer.reference.fsdp import fsdp_reference_problems

    deepspeed, fsdp = setup.deepspeed_config is not None, setup.fsdp_plugin is not None
    peft_reference = setup.adapter_disabled_reference(args)
    problems: list[Problem] = []
    if not args.uses_reference and setup.ref_model_given:
        reason = args.no_reference_reason()
        problems.append(("reference_conflict", f"{reason} builds no reference: do not pass ref_model."))
    if args.ref_offload_params and not deepspeed and not fsdp:
        problems.append(
            (
                "unsupported_combination",
                "ref_offload_params=True offloads the parameters of a sharded reference (DeepSpeed ZeRO-3 or FSDP2), "
                "but this run uses neither: launch with a ZeRO-3 or FSDP2 config, or leave ref_offload_params unset.",
            )
        )
    problems.extend(fsdp_reference_problems(args, fsdp=fsdp, peft_reference=peft_reference))
    if args.ref_zero_stage is not None and not deepspeed:
        problems.append(
            (
                "unsupported_combination",
                f"ref_zero_stage={args.ref_zero_stage} sets the ZeRO stage of a DeepSpeed reference engine, but this "
                "run does not use DeepSpeed: launch with a DeepSpeed config, or leave ref_zero_stage unset.",
            )
        )
    if setup.deepspeed_config is not None and args.uses_reference and not peft_reference:
        from pair_dpo_trainer.reference.engine import reference_zero_stage_problems

        problems.extend(
            reference_zero_stage_problems(
                setup.deepspeed_config, zero_stage=args.ref_zero_stage, offload_params=args.ref_offload_params
            )
        )
    if args.sync_ref_model and (deepspeed or fsdp):
        problems.append(
            (
                "unsupported_combination",
                "sync_ref_model=True (TR-DPO) mixes whole policy weights into an in-process reference; under DeepSpeed "
                "the reference is its own engine and under FSDP2 both are sharded: train without DeepSpeed / FSDP2 "
                "(single process or DDP), or set sync_ref_model=False.",
            )
        )
    if peft_reference:
        problems.extend(_adapter_disabled_reference_problems(args))
    return problems


def _adapter_disabled_reference_problems(args: PairDPOConfig) -> list[Problem]:
    problems: list[Problem] = []
    if args.sync_ref_model:
        problems.append(
            (
                "unsupported_combination",
                "sync_ref_model=True (TR-DPO) mixes the policy into a separate reference, but a PEFT policy's "
                "reference is the policy itself with its adapters disabled: set ref_model_name_or_path, or "
                "sync_ref_model=False.",
            )
        )
    if args.ref_zero_stage is not None or args.ref_offload_params or args.ref_fsdp_shard is not None:
        problems.append(
            (
                "unsupported_combination",
                "the reference of a PEFT policy is the policy itself with its adapters disabled, so ref_zero_stage, "
                "ref_fsdp_shard and ref_offload_params do not apply: unset them, or set ref_model_name_or_path for a "
                "separate reference.",
            )
        )
    return problems


def compile_problems(args: PairDPOConfig, setup: RunSetup) -> list[Problem]:
    """``torch_compile=True`` with ZeRO-3 (its parameter hooks cannot be traced) or the host-synced SDPA kernel."""
    if not args.torch_compile:
        return []
    problems: list[Problem] = []
    if setup.zero3:
        problems.append(
            (
                "unsupported_combination",
                "torch_compile=True is not supported with DeepSpeed ZeRO-3 (its per-module parameter hooks cannot be "
                "traced inside a compiled layer): set torch_compile=False, or use a single GPU, DDP or ZeRO-1/2.",
            )
        )
    if setup.attn_backend == "sdpa_segments":
        problems.append(
            (
                "unsupported_combination",
                "torch_compile=True needs a varlen attention kernel (attn_backend 'torch_varlen' or 'flash_attn': a "
                "CUDA device with bf16/fp16); 'sdpa_segments' reads the segment bounds on the host, which splits every "
                "compiled layer into pieces that recompile as the packed rows change: set torch_compile=False here.",
            )
        )
    return problems
