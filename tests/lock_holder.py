"""Test-only: take the output-dir lock in a process of its own, so a test can put holder and contender in different
PID namespaces (``unshare --pid --fork --mount-proc``) and kill the holder for real.

- ``python tests/lock_holder.py hold DIR READY [fork]``: takes the lock of DIR, writes READY, then sleeps until
  killed; with ``fork`` it first forks a child that keeps running (as a DataLoader worker would, sharing its
  descriptors) and writes that child's pid into READY's second line.
- ``python tests/lock_holder.py try DIR``: tries once and prints one JSON line: ``outcome`` (``acquired`` /
  ``refused``), ``warning`` or ``reason_code`` and ``message``, and its own ``pid`` and ``pid_namespace``.

With ``LOCK_HOLDER_START_AT`` (seconds since the epoch) set, either waits until then before it takes the lock, so
two processes can race for it at the same instant.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_dpo_trainer.errors import RunError  # noqa: E402
from pair_dpo_trainer.fault_tolerance.lock import acquire_output_dir  # noqa: E402


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    namespace = os.readlink("/proc/self/ns/pid")
    time.sleep(max(float(os.environ.get("LOCK_HOLDER_START_AT", 0)) - time.time(), 0))
    if mode == "hold":
        acquire_output_dir(directory)
        child = os.fork() if sys.argv[4:] == ["fork"] else None
        if child == 0:
            time.sleep(3600)
            os._exit(0)
        Path(sys.argv[3]).write_text(f"{os.getpid()} {namespace}\n{child or ''}\n")
        time.sleep(3600)
        return
    try:
        warning = acquire_output_dir(directory)
        result = {"outcome": "acquired", "warning": warning}
    except RunError as exc:
        result = {"outcome": "refused", "reason_code": exc.reason_code, "message": exc.message}
    print(json.dumps({**result, "pid": os.getpid(), "pid_namespace": namespace}), flush=True)


if __name__ == "__main__":
    main()
