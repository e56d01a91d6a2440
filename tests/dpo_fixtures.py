"""Shared builders for trainer tests: synthetic tokenised pairs and configs (no files, no downloads); the tiny models
are in :mod:`tests.models`."""

from __future__ import annotations

import random

from tests.models import EOS, VOCAB


def synthetic_pairs(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` tokenised pairs with varied lengths; completions end with EOS and chosen != rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 12))]
        chosen = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 10))] + [EOS]
        rejected = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 10))] + [EOS]
        if rejected == chosen:
            rejected = [4] + rejected
        rows.append({"prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected})
    return rows


def cpu_config(tmp_path, **overrides):
    """A ``PairDPOConfig`` for single-process CPU tests (unpinned in-memory reference allowed); overrides win."""
    from pair_dpo_trainer import PairDPOConfig

    options = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        allow_unpinned_reference=True,
    )
    options.update(overrides)
    return PairDPOConfig(**options)


def run_setup(**overrides):
    """A ``training.checks.RunSetup`` of a single-process CPU run (no DeepSpeed, no FSDP, no PEFT, no ``ref_model``)."""
    from pair_dpo_trainer.training.checks import RunSetup

    fields = {
        "deepspeed_config": None,
        "fsdp_plugin": None,
        "process_group": False,
        "peft_policy": False,
        "ref_model_given": False,
        "attn_backend": "sdpa_segments",
        "zero3": False,
    }
    return RunSetup(**{**fields, **overrides})


def runtime_error(args, **overrides):
    """The ``ConfigError`` the trainer's one runtime check raises for ``args`` in that setup (None: none)."""
    from pair_dpo_trainer.errors import ConfigError, raise_problems
    from pair_dpo_trainer.training.checks import run_problems

    try:
        raise_problems(run_problems(args, run_setup(**overrides)))
    except ConfigError as error:
        return error
    return None


def random_features(
    seed: int | random.Random,
    n: int,
    *,
    vocab: int,
    prompt_len: tuple[int, int],
    completion_len: tuple[int, int],
    first_id: int = 1,
) -> list[dict[str, list[int]]]:
    """``n`` tokenised pairs of random ids in ``[first_id, vocab)`` with lengths drawn from the given ranges.

    Args:
        seed: A seed or a ``random.Random`` to draw from.
        n: Number of pairs.
        vocab: Exclusive upper bound of the ids.
        prompt_len / completion_len: Inclusive ``(low, high)`` lengths of the prompt and of each completion.
        first_id: Smallest id (keep special ids out).
    """
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)

    def ids(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(first_id, vocab) for _ in range(rng.randint(*bounds))]

    return [
        {
            "prompt_input_ids": ids(prompt_len),
            "chosen_input_ids": ids(completion_len),
            "rejected_input_ids": ids(completion_len),
        }
        for _ in range(n)
    ]
