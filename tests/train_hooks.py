"""Test-only: ``train.py`` with hooks, so a test can signal it at a known point of a known phase.

Run it exactly as train.py (``python tests/train_hooks.py FLAGS``, or under any launcher); ``PAIR_DPO_TEST_HOOKS``
holds a JSON object:

- ``progress``: a file each rank appends ``rank step time`` to after every optimizer step; ``step_sleep``: seconds
  each step then waits (so a signal lands mid-run);
- ``pause``: ``{"phase": P, "file": F, "seconds": S}``: inside phase P the process writes F and waits S seconds. P is
  ``tokenise`` (inside the tokenised-pairs cache build, its temporary directory written), ``evaluate`` (inside
  train.py's final ``evaluate()``) or ``save`` (inside train.py's final ``save_model()``, before it writes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from pair_dpo_trainer import PairDPOTrainer  # noqa: E402
from pair_dpo_trainer.data import cache  # noqa: E402
from pair_dpo_trainer.parallel.collectives import end_process_group  # noqa: E402
from tests.fault_worker import StepHooks  # noqa: E402

HOOKS: dict[str, Any] = json.loads(os.environ.get("PAIR_DPO_TEST_HOOKS", "{}"))


def _pause(phase: str) -> None:
    pause = HOOKS.get("pause") or {}
    if pause.get("phase") == phase and int(os.environ.get("RANK", "0")) == 0:
        Path(pause["file"]).write_text(f"{os.getpid()}\n")
        time.sleep(pause.get("seconds", 60))


def install() -> None:
    init, evaluation_loop, save = PairDPOTrainer.__init__, PairDPOTrainer.evaluation_loop, PairDPOTrainer._save
    get_or_build = cache.PairCache.get_or_build

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(StepHooks({"progress": HOOKS.get("progress"), "step_sleep": HOOKS.get("step_sleep")}))

    def patched_evaluation_loop(self, *args, **kwargs):
        if self.state.global_step == self.state.max_steps > 0:  # train.py's final evaluate, after training
            _pause("evaluate")
        return evaluation_loop(self, *args, **kwargs)

    def patched_save(self, output_dir=None, state_dict=None):
        if output_dir is None or str(output_dir) == str(self.args.output_dir):  # the final model, not a checkpoint
            _pause("save")
        return save(self, output_dir, state_dict)

    def patched_get_or_build(self, key, build, **kwargs):
        def paused_build(directory):
            result = build(directory)  # the entry's files are in the temporary directory now
            _pause("tokenise")
            return result

        return get_or_build(self, key, paused_build, **kwargs)

    PairDPOTrainer.__init__ = patched_init
    PairDPOTrainer.evaluation_loop = patched_evaluation_loop
    PairDPOTrainer._save = patched_save
    cache.PairCache.get_or_build = patched_get_or_build


if __name__ == "__main__":
    install()
    train.main()
    end_process_group()  # as train.py's own __main__
