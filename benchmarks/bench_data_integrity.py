"""What trusting token data costs: verifying a prepared split's digest (one thread vs every core) and the token-id
range check, on a synthetic split of N pairs.

::

    # a train.arrow of N pairs (PREPARED_SCHEMA, written by the package's own StreamWriter, so with its digest) of
    # --prompt prompt ids and --completion ids per completion (256 + 256: 512 tokens per branch by default)
    python -m benchmarks.bench_data_integrity --pairs 1000000 --dir /tmp/bench-integrity [--repeats 3]

Prints one JSON line per measurement (also appended to ``--results``, default ``bench_data_integrity.jsonl``): the
file size, the best and all of ``--repeats`` timings of the chunked digest with 1 thread and with every core, of a
plain streamed SHA-256 (``integrity.hashing.hash_file``) for scale, and of ``data.token_ids.check_token_ids`` on the
memory-mapped split. The file is read from the page cache after the first pass (the machine's memory permitting):
the timings are of hashing and checking, not of the disk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

VOCAB = 151_936
"""Token ids are drawn below this (a Qwen2-sized vocabulary) and checked against it."""


def _emit(results: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(results, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _ids(rng: np.random.Generator, rows: int, length: int) -> pa.ListArray:
    offsets = np.arange(0, (rows + 1) * length, length, dtype=np.int32)
    values = rng.integers(0, VOCAB, size=rows * length, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def make_split(path: Path, pairs: int, prompt: int, completion: int, batch_rows: int = 8192) -> dict:
    """Writes ``path`` (a prepared ``train.arrow``); returns what a manifest records of it."""
    from pair_dpo_trainer.data.arrow import StreamWriter
    from pair_dpo_trainer.data.prepared import PREPARED_SCHEMA

    rng = np.random.default_rng(0)
    with StreamWriter(path, PREPARED_SCHEMA) as writer:
        for start in range(0, pairs, batch_rows):
            n = min(batch_rows, pairs - start)
            columns = [_ids(rng, n, prompt), _ids(rng, n, completion), _ids(rng, n, completion)]
            columns += [pa.array([f"{i:064x}" for i in range(start, start + n)]), pa.array(["bench"] * n)]
            columns += [pa.array(np.arange(start, start + n, dtype=np.int64)), pa.array(["{}"] * n)]
            writer.write(pa.RecordBatch.from_arrays(columns, schema=PREPARED_SCHEMA))
    written = writer.close()
    return {"rows": written.rows, "size": written.size, "sha256": written.sha256, "digest": written.digest}


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    times, value = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        value = fn()
        times.append(round(time.perf_counter() - started, 3))
    return times, value


def run(args: argparse.Namespace) -> None:
    from pair_dpo_trainer.data.arrow import open_arrow
    from pair_dpo_trainer.data.token_ids import check_token_ids
    from pair_dpo_trainer.integrity.hashing import default_threads, digest_per_record, hash_file

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "train.arrow"
    started = time.perf_counter()
    record = make_split(path, args.pairs, args.prompt, args.completion)
    base = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "pairs": args.pairs,
        "tokens_per_branch": args.prompt + args.completion,
        "file_bytes": record["size"],
    }
    _emit(
        args.results,
        {
            **base,
            "what": "write (StreamWriter: SHA-256 + chunked digest)",
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
    hash_file(path, "lfs")  # one pass to bring the file into the page cache
    cores = default_threads(len(os.sched_getaffinity(0)))
    cases = [
        ("chunked digest, 1 thread", lambda: digest_per_record(path, record["digest"], threads=1)[0]),
        (f"chunked digest, {cores} threads", lambda: digest_per_record(path, record["digest"])[0]),
        ("plain SHA-256 (hash_file, 1 thread)", lambda: hash_file(path, "lfs")[0]),
    ]
    for what, fn in cases:
        times, digest = _timed(fn, args.repeats)
        assert digest in (record["digest"]["digest"], record["sha256"]), what
        gbps = round(record["size"] / min(times) / 1e9, 2)
        _emit(args.results, {**base, "what": what, "best_s": min(times), "all_s": times, "GB_per_s": gbps})
    dataset = open_arrow(path)
    times, _ = _timed(lambda: check_token_ids(dataset, VOCAB, "bench"), args.repeats)
    _emit(args.results, {**base, "what": "check_token_ids (3 id columns)", "best_s": min(times), "all_s": times})
    if not args.keep:
        path.unlink()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--prompt", type=int, default=256, help="prompt ids per pair")
    parser.add_argument("--completion", type=int, default=256, help="ids per completion (chosen, rejected)")
    parser.add_argument("--dir", default="/tmp/bench-data-integrity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the Arrow file")
    parser.add_argument("--results", default="bench_data_integrity.jsonl")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
