"""Options a TRL user (or an old script of ours) passes that pair DPO does not take, and what to use instead.

``PairDPOConfig(rpo_alpha=0.1)`` would otherwise fail with Python's ``TypeError: __init__() got an unexpected keyword
argument``: a dataclass ``__init__`` rejects unknown keywords before ``__post_init__`` runs. ``PairDPOConfig.__new__``
(which receives the same keywords first), ``train.py`` (flags and YAML/JSON keys, before argparse would reject them)
and ``PairDPOTrainer.__init__`` (its keyword arguments) call :func:`reject_unsupported_options`, which raises one
``ConfigError`` (``unsupported_option``) naming the equivalent of every such option. docs/migrating_from_trl.md has
the side-by-side table.

A name is rejected only when it is not a real field of the config class being built, so an option another part of
the package implements (e.g. the loss fields ``loss_weights``, ``use_weighting``, ``ld_alpha``,
``f_divergence_type``, ``sync_ref_model``, ...) is never listed here and never blocked.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable

from pair_dpo_trainer.errors import ConfigError

_LOAD_YOURSELF = (
    "load the model yourself (AutoModelForCausalLM.from_pretrained(DIR, ...)) and pass the object as model=; the "
    "reference is verified from its directory (model.name_or_path) or ref_model_name_or_path"
)

# TRL 1.16 DPOConfig fields (and fields of older TRL releases that scripts still carry) with no twin here.
TRL_CONFIG_EQUIVALENTS: dict[str, str] = {
    "model_init_kwargs": _LOAD_YOURSELF,
    "ref_model_init_kwargs": "load the reference from its own directory: ref_model_name_or_path + ref_model_revision",
    "trust_remote_code": _LOAD_YOURSELF + " (pass trust_remote_code there)",
    "router_aux_loss_coef": "none: the Mixture-of-Experts auxiliary loss is not added to the DPO loss",
    "disable_dropout": "set the model's dropout rates to 0 in its config before passing it (the reference always "
    "runs in eval mode; pair DPO does not change the policy's dropout)",
    "max_completion_length": "max_length bounds prompt + completion and max_prompt_length the prompt, so a "
    "completion keeps at most max_length - len(prompt) tokens",
    "truncation_mode": "none needed: the prompt always keeps its end (max_prompt_length) and each completion its "
    "start (max_length); a cut completion loses its EOS",
    "padding_free": "none needed: pair DPO is always padding-free (packed rows, varlen attention); remove it",
    "pad_to_multiple_of": "none needed: packed rows have no padding; remove it",
    "padding_value": "none needed: packed rows have no padding; remove it",
    "label_pad_token_id": "none needed: completion tokens are selected by a mask, not by a label pad id; remove it",
    "pad_token": "set tokenizer.pad_token and pass the tokenizer as processing_class",
    "precompute_ref_batch_size": "per_device_eval_batch_size (pairs per micro-batch of the reference pass of "
    "precompute_ref_log_probs=True)",
    "activation_offloading": "none: use gradient_checkpointing=True, or DeepSpeed ZeRO-3 with CPU offload "
    "(accelerate_configs/zero3_offload.yaml)",
    "rpo_alpha": "loss_type='sigmoid_nll' with nll_weight=<rpo_alpha> (DPO plus the length-normalised NLL of the "
    "chosen completion, Pang et al. 2024)",
    "generate_during_eval": "none: evaluation reports DPO metrics only; generate from a saved checkpoint",
    "model_adapter_name": "pass a peft.PeftModel as model: its reference is the base model with adapters disabled",
    "ref_adapter_name": "pass a peft.PeftModel as model: its reference is the base model with adapters disabled",
    "force_use_ref_model": "pass ref_model_name_or_path (+ ref_model_revision) to use a separate reference with a "
    "PEFT policy",
    "use_logits_to_keep": "none needed: log-probs are computed only at completion tokens, in vocabulary chunks",
    "use_num_logits_to_keep": "none needed: log-probs are computed only at completion tokens, in vocabulary chunks",
    "is_encoder_decoder": "none: only decoder-only causal LMs are supported",
    "tools": "none: tool turns are not supported (map them to user/assistant text)",
    "use_liger_loss": "none needed: log-probs are computed in vocabulary chunks (logps_chunk_size), never as a "
    "[T, V] float32 tensor",
}

# Our own earlier names.
RENAMED_OPTIONS: dict[str, str] = {
    "precompute_ref_logps": "precompute_ref_log_probs (renamed to TRL's name)",
}

# Our own earlier objective names (loss_type values), refused with TRL's name for the same formula.
RENAMED_LOSS_TYPES: dict[str, str] = {
    "ipo_norm": "'ipo' (TRL's per-token IPO, the same formula; the summed form of the IPO paper is 'ipo_sum')",
}

# Keyword arguments of TRL's DPOTrainer (or transformers' Trainer) that PairDPOTrainer does not take.
TRAINER_KWARG_EQUIVALENTS: dict[str, str] = {
    "tokenizer": "processing_class=tokenizer",
    "quantization_config": "load the quantised model yourself (from_pretrained(DIR, quantization_config=...)) and "
    "pass model=",
    "data_collator": "none: the packed pair collator is built in; remove it",
    "compute_metrics": "none: evaluation reports the DPO metrics (eval_loss, eval_rewards/*, eval_logps/*); "
    "compute others from a saved checkpoint",
}


def unsupported_option_problems(
    names: Iterable[str], *, table: dict[str, str], known: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """``(reason_code, message)`` for each name in ``table`` (or renamed) that is not one of ``known``.

    Args:
        names: Option names as given (flags may use ``-`` for ``_``).
        table: Name -> equivalent (``TRL_CONFIG_EQUIVALENTS`` or ``TRAINER_KWARG_EQUIVALENTS``).
        known: Names that are real options of the target (never rejected).
    """
    known = set(known)
    problems = []
    for given in names:
        name = given.replace("-", "_")
        equivalent = table.get(name) or RENAMED_OPTIONS.get(name)
        if equivalent is not None and name not in known:
            problems.append(("unsupported_option", f"{name}: not an option of pair DPO; use instead: {equivalent}."))
    return problems


def reject_unsupported_options(
    names: Iterable[str], *, where: str, table: dict[str, str] = TRL_CONFIG_EQUIVALENTS, known: Iterable[str] = ()
) -> None:
    """Raises one ``ConfigError`` (``unsupported_option``) listing every unsupported name with its equivalent.

    Args:
        names: Option names as given.
        where: What received them (``"PairDPOConfig"``, ``"train.py"``, ``"PairDPOTrainer"``), for the message.
        table: Name -> equivalent.
        known: Real option names of the target (never rejected).

    Raises:
        ConfigError: ``unsupported_option``.
    """
    problems = unsupported_option_problems(names, table=table, known=known)
    if problems:
        lines = "\n".join(f"  - {text}" for _, text in problems)
        message = f"{where} got {len(problems)} unsupported option(s):\n{lines}"
        raise ConfigError("unsupported_option", message, problems=problems)


def unknown_option_problems(names: Iterable[str], *, known: Iterable[str], prefix: str = "--") -> list[tuple[str, str]]:
    """``("unknown_option", message)`` for each name that is not one of ``known``, naming the closest known name.

    Args:
        names: Option names as given (without the flag's ``--``).
        known: Every option name the target takes.
        prefix: How the names are written where they were given (``--`` for flags, ``""`` for file keys).

    Example:
        >>> unknown_option_problems(["learning_rat", "beta"], known=["learning_rate", "beta"])
        [('unknown_option', '--learning_rat is not an option: did you mean --learning_rate?')]
    """
    choices = sorted(set(known))
    problems = []
    for name in names:
        if name in choices:
            continue
        close = difflib.get_close_matches(name.replace("-", "_"), choices, n=1)
        fix = f"did you mean {prefix}{close[0]}?" if close else "train.py --help lists every option."
        problems.append(("unknown_option", f"{prefix}{name} is not an option: {fix}"))
    return problems


def config_field_names(cls: type) -> set[str]:
    """The dataclass field names of a config class (every option it takes)."""
    return {f.name for f in dataclasses.fields(cls)}
