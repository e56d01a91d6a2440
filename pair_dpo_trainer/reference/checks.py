"""Which reference options fit the run: the objectives (a reference-free run has no reference to configure), the pin
format, and the launch (DeepSpeed, FSDP2, a PEFT policy whose reference is itself with adapters disabled).

:func:`reference_option_problems` needs only the config; :func:`reference_run_problems` needs what the Accelerator
knows. Both are collected by ``training.checks`` with the other features' checks and raised once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pair_dpo_trainer.config.sections import ReferenceOptions
from pair_dpo_trainer.errors import Problem
from pair_dpo_trainer.integrity.layout import is_pinned_revision
from pair_dpo_trainer.reference.deepspeed import reference_zero_stage_problems
from pair_dpo_trainer.reference.fsdp import fsdp_reference_problems

IGNORED_WITHOUT_REFERENCE = ("ref_model_name_or_path", "ref_model_revision", "ref_model_repo_id")
"""Reference settings a run that builds no reference ignores (named in the run summary, never refused: switching
``reference_free`` or to a reference-free objective is one option)."""


def ignored_reference_settings(reference: ReferenceOptions, *, ref_model_given: bool = False) -> list[str]:
    """The reference settings (and a ``ref_model`` object) that a reference-free run does not use.

    Example:
        >>> options = ReferenceOptions(uses_reference=False, ref_model_revision="a" * 40)
        >>> ignored_reference_settings(options, ref_model_given=True)
        ['ref_model_revision', 'ref_model']
    """
    if reference.uses_reference:
        return []
    ignored = [name for name in IGNORED_WITHOUT_REFERENCE if getattr(reference, name) is not None]
    return ignored + (["ref_model"] if ref_model_given else [])


def reference_option_problems(reference: ReferenceOptions) -> list[Problem]:
    """A precomputed reference in a run without one, and a revision that is not a full commit (the other reference
    settings of a reference-free run are ignored: :func:`ignored_reference_settings`)."""
    problems: list[Problem] = []
    if not reference.uses_reference:
        reason = reference.no_reference_reason
        if reference.precompute_ref_log_probs:
            problems.append(
                (
                    "unsupported_combination",
                    f"precompute_ref_log_probs=True has nothing to precompute with {reason} (no reference log-probs "
                    "are used): set precompute_ref_log_probs=False.",
                )
            )
    revision = reference.ref_model_revision
    if reference.uses_reference and revision is not None and not is_pinned_revision(revision):
        problems.append(
            (
                "revision_not_pinned",
                f"ref_model_revision={revision!r}: give the full 40-hex lowercase commit (branch "
                "names, tags and short SHAs move or are ambiguous).",
            )
        )
    return problems


def adapter_disabled_reference(reference: ReferenceOptions, *, peft_policy: bool, ref_model_given: bool) -> bool:
    """Whether the reference is the PEFT policy with its adapters disabled (no separate model)."""
    return reference.uses_reference and not ref_model_given and not reference.ref_model_name_or_path and peft_policy


def reference_run_problems(
    reference: ReferenceOptions,
    *,
    deepspeed_config: Mapping[str, Any] | None,
    fsdp: bool,
    peft_policy: bool,
    ref_model_given: bool,
) -> list[Problem]:
    """The reference options that do not fit this run (what ``reference.build`` would otherwise ignore or fail on)."""
    deepspeed = deepspeed_config is not None
    peft_reference = adapter_disabled_reference(reference, peft_policy=peft_policy, ref_model_given=ref_model_given)
    problems: list[Problem] = []
    if reference.ref_offload_params and not deepspeed and not fsdp:
        problems.append(
            (
                "unsupported_combination",
                "ref_offload_params=True offloads the parameters of a sharded reference (DeepSpeed ZeRO-3 or FSDP2), "
                "but this run uses neither: launch with a ZeRO-3 or FSDP2 config, or leave ref_offload_params unset.",
            )
        )
    problems.extend(fsdp_reference_problems(reference, fsdp=fsdp, peft_reference=peft_reference))
    stage = reference.ref_zero_stage
    if stage is not None and not deepspeed:
        problems.append(
            (
                "unsupported_combination",
                f"ref_zero_stage={stage} sets the ZeRO stage of a DeepSpeed reference engine, but this "
                "run does not use DeepSpeed: launch with a DeepSpeed config, or leave ref_zero_stage unset.",
            )
        )
    if deepspeed_config is not None and reference.uses_reference and not peft_reference:
        problems.extend(
            reference_zero_stage_problems(
                deepspeed_config, zero_stage=reference.ref_zero_stage, offload_params=reference.ref_offload_params
            )
        )
    if reference.sync_ref_model and (deepspeed or fsdp):
        problems.append(
            (
                "unsupported_combination",
                "sync_ref_model=True (TR-DPO) mixes whole policy weights into an in-process reference; under DeepSpeed "
                "the reference is its own engine and under FSDP2 both are sharded: train without DeepSpeed / FSDP2 "
                "(single process or DDP), or set sync_ref_model=False.",
            )
        )
    if peft_reference:
        problems.extend(_adapter_disabled_reference_problems(reference))
    return problems


def _adapter_disabled_reference_problems(reference: ReferenceOptions) -> list[Problem]:
    problems: list[Problem] = []
    if reference.sync_ref_model:
        problems.append(
            (
                "unsupported_combination",
                "sync_ref_model=True (TR-DPO) mixes the policy into a separate reference, but a PEFT policy's "
                "reference is the policy itself with its adapters disabled: set ref_model_name_or_path, or "
                "sync_ref_model=False.",
            )
        )
    if reference.ref_zero_stage is not None or reference.ref_offload_params or reference.ref_fsdp_shard is not None:
        problems.append(
            (
                "unsupported_combination",
                "the reference of a PEFT policy is the policy itself with its adapters disabled, so ref_zero_stage, "
                "ref_fsdp_shard and ref_offload_params do not apply: unset them, or set ref_model_name_or_path for a "
                "separate reference.",
            )
        )
    return problems
