"""The demo preference pairs: short list tasks (sort, alphabetize, count) whose rejected answer is the chosen one with
one adjacent pair of distinct items swapped, so the error is local (one bad bigram) and a tiny causal LM learns it
with DPO in minutes on a CPU. Deterministic from a seed; ``demo_assets.py`` writes them to
``pair_dpo_trainer/assets/demo_pairs.jsonl``, and tests draw fresh rows from here.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterable, Mapping, Sequence

from pair_dpo_trainer.demo import DEMO_SEED

DEMO_NUM_PAIRS = 2400
_MIN_ITEMS, _MAX_ITEMS = 3, 12
_SORT_VALUES = 20  # sort tasks draw integers in [0, 20)
_COUNT_VALUES = 100  # count tasks run inside [0, 100)
BASE_WORDS = tuple(str(i) for i in range(_COUNT_VALUES)) + tuple(string.ascii_lowercase)


# --------------------------------------------------------------------------------------------------- pairs


def _mixed_items(rng: random.Random, pool: Sequence[str]) -> list[str]:
    """Draw 3-12 items with replacement from ``pool``, at least two of them distinct.

    Args:
        rng: Source of randomness.
        pool: Candidate items.

    Returns:
        list[str]: The drawn items, in draw order.
    """
    while True:
        items = [rng.choice(pool) for _ in range(rng.randint(_MIN_ITEMS, _MAX_ITEMS))]
        if len(set(items)) >= 2:
            return items


def _numbers(rng: random.Random) -> list[int]:
    """Draw a list of small integers for the sort tasks (values in [0, 20), repeats allowed).

    Args:
        rng: Source of randomness.

    Returns:
        list[int]: 3-12 integers, at least two distinct.
    """
    return [int(x) for x in _mixed_items(rng, [str(i) for i in range(_SORT_VALUES)])]


def _task_sort_ascending(rng: random.Random) -> tuple[str, list[str]]:
    """Build ``sort ascending: 3 9 1 4`` -> ``1 3 4 9``."""
    nums = _numbers(rng)
    return "sort ascending: " + " ".join(map(str, nums)), [str(x) for x in sorted(nums)]


def _task_sort_descending(rng: random.Random) -> tuple[str, list[str]]:
    """Build ``sort descending: 3 9 1 4`` -> ``9 4 3 1``."""
    nums = _numbers(rng)
    return "sort descending: " + " ".join(map(str, nums)), [str(x) for x in sorted(nums, reverse=True)]


def _task_alphabetize(rng: random.Random) -> tuple[str, list[str]]:
    """Build ``alphabetize: q d m`` -> ``d m q``."""
    letters = _mixed_items(rng, string.ascii_lowercase)
    return "alphabetize: " + " ".join(letters), sorted(letters)


def _count_range(rng: random.Random) -> tuple[int, int]:
    """Draw an inclusive range ``[start, stop]`` of 3-12 integers inside [0, 100).

    Args:
        rng: Source of randomness.

    Returns:
        tuple[int, int]: ``(start, stop)`` with ``stop - start + 1`` in [3, 12].
    """
    length = rng.randint(_MIN_ITEMS, _MAX_ITEMS)
    start = rng.randint(0, _COUNT_VALUES - length)
    return start, start + length - 1


def _task_count_up(rng: random.Random) -> tuple[str, list[str]]:
    """Build ``count up: 4 to 8`` -> ``4 5 6 7 8``."""
    start, stop = _count_range(rng)
    return f"count up: {start} to {stop}", [str(x) for x in range(start, stop + 1)]


def _task_count_down(rng: random.Random) -> tuple[str, list[str]]:
    """Build ``count down: 8 to 4`` -> ``8 7 6 5 4``."""
    start, stop = _count_range(rng)
    return f"count down: {stop} to {start}", [str(x) for x in range(stop, start - 1, -1)]


DemoTask = Callable[[random.Random], tuple[str, list[str]]]
DEMO_TASKS: tuple[DemoTask, ...] = (
    _task_sort_ascending,
    _task_sort_descending,
    _task_alphabetize,
    _task_count_up,
    _task_count_down,
)


def _swap_one_adjacent(rng: random.Random, items: Sequence[str]) -> list[str]:
    """Return ``items`` with one adjacent pair of distinct items swapped (the rejected answer).

    Args:
        rng: Source of randomness.
        items: The correct answer; holds at least two distinct neighbours.

    Returns:
        list[str]: A copy of ``items`` that differs from it at exactly two neighbouring positions.
    """
    positions = [j for j in range(len(items) - 1) if items[j] != items[j + 1]]
    j = rng.choice(positions)
    swapped = list(items)
    swapped[j], swapped[j + 1] = swapped[j + 1], swapped[j]
    return swapped


def _pair_row(prompt: str, chosen: str, rejected: str) -> dict:
    """Wrap one pair in the chat ``messages`` row format.

    Returns:
        dict: ``{"prompt": [user msg], "chosen": [assistant msg], "rejected": [assistant msg]}``.
    """
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def generate_demo_pairs(seed: int = DEMO_SEED, n: int = DEMO_NUM_PAIRS) -> list[dict]:
    """Generate deterministic, learnable preference pairs with unique prompts.

    Tasks rotate over :data:`DEMO_TASKS`; the rejected answer is the chosen one with one adjacent swap.

    Args:
        seed: Seed of the ``random.Random`` that draws every list.
        n: Number of pairs.

    Returns:
        list[dict]: ``n`` rows ``{"prompt", "chosen", "rejected"}``, each a list of ``{"role", "content"}``
            dicts.

    Raises:
        ValueError: If ``n`` unique prompts cannot be drawn (``n`` far beyond the task space).
    """
    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    for _ in range(100 * max(n, 1)):
        if len(rows) == n:
            return rows
        prompt, chosen = DEMO_TASKS[len(rows) % len(DEMO_TASKS)](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append(_pair_row(prompt, " ".join(chosen), " ".join(_swap_one_adjacent(rng, chosen))))
    raise ValueError(f"could not draw {n} unique demo prompts (got {len(rows)})")


def pair_texts(rows: Iterable[Mapping]) -> list[str]:
    """Collect every message content of the rows (the tokenizer's training texts).

    Args:
        rows: Rows in the chat ``messages`` format.

    Returns:
        list[str]: Contents of all prompt, chosen and rejected messages, in row order.
    """
    return [msg["content"] for row in rows for key in ("prompt", "chosen", "rejected") for msg in row[key]]
