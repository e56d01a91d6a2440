"""The one point where every option check is collected and raised once, at trainer start.

``PairDPOConfig`` checks each option's own range when it is built. The checks that need a feature's knowledge live
with the feature (``losses.checks``, ``reference.checks``, ``modeling.attention``, ``modeling.compile``,
``parallel.zero3``, ``parallel.fsdp2``); this module only collects them: :func:`check_config` before anything is
loaded (``PairDPOTrainer.__init__`` and ``train.py``), :func:`run_problems` right after the Accelerator exists
(the DeepSpeed configuration, the FSDP2 plugin, the process group, the policy, the resolved attention kernel). Each
raises one :class:`~pair_dpo_trainer.errors.ConfigError` whose ``.problems`` lists every ``(reason_code, message)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pair_dpo_trainer.config import PairDPOConfig
from pair_dpo_trainer.config.sections import FsdpOptions, LayerOptions, ObjectiveOptions
from pair_dpo_trainer.errors import Problem, raise_problems
from pair_dpo_trainer.fault_tolerance.lock import output_dir_problem
from pair_dpo_trainer.losses.checks import loss_problems
from pair_dpo_trainer.losses.registry import step_level_objectives
from pair_dpo_trainer.modeling.attention import attn_backend_problems
from pair_dpo_trainer.modeling.compile import compile_mode_problem, compile_problems
from pair_dpo_trainer.modeling.float8 import fp8_problems
from pair_dpo_trainer.modeling.tiled_mlp import tiled_mlp_problems
from pair_dpo_trainer.observability.metrics import report_to_problems
from pair_dpo_trainer.parallel.fsdp2 import fsdp2_problems
from pair_dpo_trainer.parallel.sequence import sequence_parallel_problems
from pair_dpo_trainer.parallel.zero3 import zero3_leaf_modules_problem, zero3_leaf_problems
from pair_dpo_trainer.reference.checks import reference_option_problems, reference_run_problems
from pair_dpo_trainer.training.layers import auto_checkpointing_problems
from pair_dpo_trainer.training.options import RunOptions, reference_options


def config_problems(args: PairDPOConfig) -> list[Problem]:
    """Every ``(reason_code, message)`` of the features' checks that need only the config (each check gets its
    section)."""
    reference = reference_options(args)
    problems: list[Problem] = [*loss_problems(ObjectiveOptions.from_config(args), reference)]
    problems.extend(reference_option_problems(reference))
    problems.extend(attn_backend_problems(args.attn_backend))
    compile_mode = compile_mode_problem(args.torch_compile_mode)
    if compile_mode is not None:
        problems.append(("unsupported_combination", compile_mode))
    leaf_problem = zero3_leaf_modules_problem(args.zero3_leaf_modules)
    if leaf_problem is not None:
        problems.append(("bad_zero3_leaf_modules", leaf_problem))
    problems.extend(report_to_problems(args.report_to))
    output_dir = output_dir_problem(args.output_dir) if args.output_dir is not None else None
    if output_dir is not None:
        problems.append(("output_dir_unwritable", output_dir))
    return problems


def check_config(args: PairDPOConfig) -> None:
    """Raises every problem of :func:`config_problems` at once (nothing when there is none).

    Raises:
        ConfigError: the problem's own code, or ``invalid_config`` for several.
    """
    problems = config_problems(args)
    raise_problems(problems, what="PairDPOConfig" if len(problems) > 1 else None)  # one problem: its own line


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


def run_problems(args: PairDPOConfig, setup: RunSetup, options: RunOptions | None = None) -> list[Problem]:
    """Every ``(reason_code, message)`` for option combinations this run's runtime does not support.

    Args:
        args: The run's config (its device).
        setup: What the Accelerator knows.
        options: The run's sections when the trainer built them (else read from ``args`` here).
    """
    reference = options.reference if options is not None else reference_options(args)
    layers = options.layers if options is not None else LayerOptions.from_config(args)
    fsdp = options.fsdp if options is not None else FsdpOptions.from_config(args)
    objective = options.objective if options is not None else ObjectiveOptions.from_config(args)
    problems: list[Problem] = []
    if setup.fsdp_plugin is not None:
        problems.extend(fsdp2_problems(setup.fsdp_plugin, fsdp, process_group=setup.process_group))
    problems.extend(zero3_leaf_problems(layers.zero3_leaf_modules, zero3=setup.zero3, peft=setup.peft_policy))
    problems.extend(
        reference_run_problems(
            reference,
            deepspeed_config=setup.deepspeed_config,
            fsdp=setup.fsdp_plugin is not None,
            peft_policy=setup.peft_policy,
            ref_model_given=setup.ref_model_given,
        )
    )
    problems.extend(
        compile_problems(torch_compile=layers.torch_compile, zero3=setup.zero3, attn_backend=setup.attn_backend)
    )
    deepspeed = setup.deepspeed_config is not None
    device = torch.device(args.device)
    problems.extend(fp8_problems(layers.fp8, deepspeed=deepspeed, peft=setup.peft_policy, device=device))
    sharded = setup.zero3 or setup.fsdp_plugin is not None
    mode = layers.activation_checkpointing_mode
    problems.extend(auto_checkpointing_problems(mode, device=device, sharded=sharded))
    problems.extend(
        sequence_parallel_problems(
            args.sequence_parallel_size,
            world_size=args.world_size,
            fsdp=setup.fsdp_plugin is not None,
            checkpointing_mode=mode,
            process_group=setup.process_group,
            step_objectives=step_level_objectives(objective.loss_type),
        )
    )
    problems.extend(tiled_mlp_problems(layers.tiled_mlp, sharded=sharded))
    return problems
