"""Times snapshot hashing against ``sha256sum`` and ``git hash-object`` on the same multi-GB files.

Creates ``--files`` non-sparse random files of ``--size-mib`` MiB in a temporary directory (default under
``/tmp``), warms the page cache, then reports the best of ``--repeats`` wall-clock timings of:

* single file: ``sha256sum``, ``git -c core.bigFileThreshold=64g hash-object --no-filters`` (git's fastest,
  in-memory path; the default streaming path for files over 512 MiB is timed once too),
  ``hash_file(kind="lfs")`` (SHA-256), ``hash_file(kind="git")`` (Git blob SHA-1);
* all files: ``sha256sum f1 f2 ...`` and ``verify_hashes`` with 1 and N threads, per kind;
* end to end: ``verify_snapshot`` on a snapshot whose shards are these files (metadata written by
  ``huggingface_hub``'s own writer, etags from ``sha256sum``), 1 and N threads.

The files are deleted afterwards. Usage::

    python -m benchmarks.integrity --size-mib 1024 --files 2 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pair_dpo_trainer.integrity.hashing import HashJob, hash_file, verify_hashes
from pair_dpo_trainer.integrity.snapshot import verify_snapshot

REVISION = "0123456789abcdef0123456789abcdef01234567"
BLOCK = 64 * 1024 * 1024
GIT_IN_MEMORY = ["git", "-c", "core.bigFileThreshold=64g"]
"""Git hashes files above ``core.bigFileThreshold`` (512 MiB) through its much slower streaming (deflating)
path; the baseline raises the threshold so git hashes in memory, its fastest path."""


def make_random_file(path: Path, size: int) -> None:
    """Writes ``size`` non-sparse pseudo-random bytes (a random 64 MiB block, each copy stamped)."""
    block = bytearray(os.urandom(min(BLOCK, size)))
    with open(path, "wb") as f:
        written = 0
        while written < size:
            block[:16] = os.urandom(16)
            n = min(len(block), size - written)
            f.write(memoryview(block)[:n])
            written += n
        f.flush()
        os.fsync(f.fileno())


def best_of(repeats: int, fn: Callable[[], object]) -> tuple[float, object]:
    """Returns the best wall time over ``repeats`` runs and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_tool(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def make_snapshot(root: Path, files: list[Path], sha256: dict[Path, str]) -> Path:
    """Hard-links the files into a sharded snapshot with metadata from huggingface_hub's own writer."""
    from huggingface_hub._local_folder import get_local_download_paths, write_download_metadata

    snap = root / "snapshot"
    snap.mkdir()
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for name, src in zip(names, files, strict=True):
        os.link(src, get_local_download_paths(snap, name).file_path)
        write_download_metadata(snap, name, REVISION, sha256[src])
    small = {
        "config.json": b"{}",
        "model.safetensors.index.json": json.dumps({"weight_map": {n: n for n in names}}).encode(),
    }
    for name, data in small.items():
        (snap / name).write_bytes(data)
        blob = run_tool([*GIT_IN_MEMORY, "hash-object", "--no-filters", str(snap / name)]).strip()
        write_download_metadata(snap, name, REVISION, blob)
    return snap


def bench(files: list[Path], repeats: int, threads: int) -> list[tuple[str, int, int, float]]:
    """Runs every measurement; returns rows ``(what, n_files, threads, seconds)``."""
    first = files[0]
    rows: list[tuple[str, int, int, float]] = []
    t, out = best_of(repeats, lambda: run_tool(["sha256sum", str(first)]))
    rows.append(("sha256sum", 1, 1, t))
    sha256_first = str(out).split()[0]
    t, out = best_of(repeats, lambda: run_tool([*GIT_IN_MEMORY, "hash-object", "--no-filters", str(first)]))
    rows.append(("git hash-object", 1, 1, t))
    git_first = str(out).strip()
    t, out = best_of(1, lambda: run_tool(["git", "hash-object", "--no-filters", str(first)]))
    assert str(out).strip() == git_first
    rows.append(("git hash-object (default bigFileThreshold, 1 run)", 1, 1, t))
    for kind, expected, label in (("lfs", sha256_first, "SHA-256"), ("git", git_first, "Git blob SHA-1")):
        t, result = best_of(repeats, lambda kind=kind: hash_file(first, kind))
        assert result[0] == expected, f"{kind}: {result[0]} != {expected}"  # type: ignore[index]
        rows.append((f"hash_file ({label})", 1, 1, t))
    t, out = best_of(repeats, lambda: run_tool(["sha256sum", *map(str, files)]))
    rows.append(("sha256sum", len(files), 1, t))
    sha256 = {Path(p): d for d, p in (line.split(maxsplit=1) for line in str(out).splitlines())}
    git = {f: run_tool([*GIT_IN_MEMORY, "hash-object", "--no-filters", str(f)]).strip() for f in files}
    for kind, digests, label in (("lfs", sha256, "SHA-256"), ("git", git, "Git blob SHA-1")):
        jobs = [HashJob(f.name, f, kind, digests[f], f.stat().st_size) for f in files]
        for n in sorted({1, threads}):
            t, _ = best_of(repeats, lambda n=n, jobs=jobs: verify_hashes(jobs, threads=n))
            rows.append((f"verify_hashes ({label})", len(files), n, t))
    snap = make_snapshot(files[0].parent, files, sha256)
    for n in sorted({1, threads}):
        t, _ = best_of(repeats, lambda n=n: verify_snapshot(snap, REVISION, threads=n))
        rows.append(("verify_snapshot (end to end)", len(files), n, t))
    return rows


def report(rows: list[tuple[str, int, int, float]], size: int, args: argparse.Namespace) -> str:
    """Formats the rows as the markdown table of docs/benchmarks.md."""
    base = {n: t for what, n, _, t in rows if what == "sha256sum"}
    git_base = next(t for what, _, _, t in rows if what == "git hash-object")
    lines = [
        f"- Date: {datetime.date.today().isoformat()}; machine: {args.machine} ({os.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}); Python {platform.python_version()}.",
        f"- Command: `python -m benchmarks.integrity --size-mib {args.size_mib} --files {args.files} "
        f"--repeats {args.repeats} --threads {args.threads}` (best of {args.repeats}, warm page cache).",
        "",
        "| what | files | threads | seconds | GiB/s | speed vs sha256sum | speed vs git hash-object |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, n, threads, t in rows:
        gib = n * size / 2**30
        vs_git = f"{git_base / t:.2f}x" if n == 1 else "-"
        lines.append(f"| {what} | {n} | {threads} | {t:.2f} | {gib / t:.2f} | {base[n] / t:.2f}x | {vs_git} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="Size of each file in MiB.")
    parser.add_argument("--files", type=int, default=2, help="Number of files.")
    parser.add_argument("--repeats", type=int, default=3, help="Timings per measurement (best is kept).")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Threads for the N-thread rows.")
    parser.add_argument("--dir", default="/tmp", help="Where to create the temporary files.")
    parser.add_argument("--machine", default="2-core CPU dev machine", help="Machine description for the report.")
    args = parser.parse_args()
    size = args.size_mib * 1024 * 1024
    work = Path(tempfile.mkdtemp(prefix="pair_dpo_bench_", dir=args.dir))
    try:
        files = [work / f"blob{i}.bin" for i in range(args.files)]
        for f in files:
            make_random_file(f, size)
        for f in files:  # warm the page cache so every tool reads from memory
            subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
        print(report(bench(files, args.repeats, args.threads), size, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
