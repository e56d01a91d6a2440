"""Data at scale: ``prepare-data`` speed per worker count, and the trainer's memory and tokenisation CPU
time per rank with 1k vs 1M raw pairs.

Subcommands (all with the bundled tiny-llama tokenizer; numbers go to docs/benchmarks.md, never into tests)::

    # rows of the demo's shape (short) or of ~T tokens per pair (prompt, chosen, rejected: T/3 each)
    python -m benchmarks.bench_data_scale make-input --rows 200000 --out /tmp/rows.jsonl [--tokens 800] [--arrow]
    # prepare-data with each worker count on the same input, best and all of --repeats runs, same-call ratios
    python -m benchmarks.bench_data_scale prepare --input /tmp/rows.jsonl --num-proc 1 2 --repeats 3
    # 2 CPU processes (torchrun, gloo) train --steps steps on N raw pairs given as a memory-mapped datasets.Dataset;
    # per rank: peak RSS (total, anonymous, file-backed), CPU seconds while the trainer is built (self + workers)
    python -m benchmarks.bench_data_scale trainer --pairs 1000 1000000 --tokens 800 --num-proc 2

Every line of results is also appended as JSON to ``--results`` (default ``bench_data_scale.jsonl``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root, put on the trainer subprocesses' PYTHONPATH

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def _emit(results: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(results, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _environment() -> dict:
    import datasets
    import pyarrow
    import tokenizers
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "load": os.getloadavg(),
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "datasets": datasets.__version__,
        "pyarrow": pyarrow.__version__,
        "cpu": _lscpu(),
    }


def _lscpu() -> dict[str, str]:
    """The CPU's model and topology (threads per core: are the cores hyper-threads?) from ``lscpu``, if it runs."""
    wanted = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU max MHz")
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {name.strip(): value.strip() for name, value in fields if name.strip() in wanted}


# ------------------------------------------------------------------------------------------------ inputs


def _long_texts(count: int, words: int, seed: int) -> list[str]:
    """``count`` strings of ``words`` numbers 0-99 (one token each for the bundled tokenizer)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    numbers = rng.integers(0, 100, size=(count, words)).astype(str)
    return [" ".join(row) for row in numbers]


def iter_rows(rows: int, tokens: int | None, seed: int = 0, label=str):
    """Rows of the demo's shape (``tokens=None``) or three plain strings of ``tokens / 3`` tokens each; every prompt is
    unique (``label(row number)`` leads it); the texts come from a pool of 4096 (generation would otherwise
    dominate)."""
    from pair_dpo_trainer.demo.pairs import generate_demo_pairs

    if tokens is None:
        pool = generate_demo_pairs(seed=seed, n=4096)
        for i in range(rows):
            row = pool[i % len(pool)]
            prompt = [{"role": "user", "content": f"{label(i)} {row['prompt'][0]['content']}"}]
            yield {"prompt": prompt, "chosen": row["chosen"], "rejected": row["rejected"]}
        return
    third = max(1, tokens // 3)
    pool = _long_texts(4096, third, seed)
    for i in range(rows):
        a, b, c = pool[i % 4096], pool[(i * 7 + 1) % 4096], pool[(i * 13 + 2) % 4096]
        yield {"prompt": f"{label(i)} {a}", "chosen": b, "rejected": c}


_MARK = "@@row@@"


def iter_json_lines(rows: int, tokens: int | None, seed: int = 0):
    """``json.dumps(row) + "\\n"`` for each row of :func:`iter_rows`. Rows of the demo's shape repeat the pool with
    period 4096 but for the row number, so each pool row is serialised once with a mark where the number goes (digits
    need no JSON escaping): a million lines in seconds, not a minute (the GPU machine's call is capped)."""
    if tokens is not None:  # three pool indices per row, no short period: serialise each row
        for row in iter_rows(rows, tokens, seed):
            yield json.dumps(row) + "\n"
        return
    templates = [json.dumps(r).split(_MARK) for r in iter_rows(min(rows, 4096), None, seed, label=lambda _: _MARK)]
    assert all(len(parts) == 2 for parts in templates), "the mark occurs in a pool text"
    for i in range(rows):
        head, tail = templates[i % len(templates)]
        yield f"{head}{i}{tail}\n"


def make_input(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    if args.arrow:
        import pyarrow as pa

        from pair_dpo_trainer.data.arrow import StreamWriter

        schema = pa.schema([(c, pa.string()) for c in PAIR_COLUMNS])
        with StreamWriter(args.out, schema) as writer:
            batch: list[dict] = []
            for row in iter_rows(args.rows, args.tokens, args.seed):
                batch.append(row)
                if len(batch) == 10_000:
                    writer.write(pa.RecordBatch.from_pylist(batch, schema=schema))
                    batch = []
            writer.write(pa.RecordBatch.from_pylist(batch, schema=schema))
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(iter_json_lines(args.rows, args.tokens, args.seed))
    size = Path(args.out).stat().st_size
    print(f"wrote {args.rows} rows, {size / 1e6:.1f} MB, to {args.out} in {time.perf_counter() - start:.1f} s")


# ------------------------------------------------------------------------------------------------ prepare-data


def prepare(args: argparse.Namespace) -> None:
    """``prepare-data`` in this process (imports and the tokenizer warmed by a first tiny call, so the times are the
    command's work, not Python's start-up), once per worker count and repeat, on the same input."""
    import contextlib
    import io

    from pair_dpo_trainer.cli import main as cli_main
    from pair_dpo_trainer.demo import bundled_model_dir

    rows = sum(1 for line in open(args.input, "rb") if line.strip())
    env = _environment()
    tokenizer = str(bundled_model_dir())

    def call(source: str, out: Path, workers: int, train: int, eval_: int) -> dict[str, float]:
        argv = ["prepare-data", source, "--output", str(out), "--tokenizer", tokenizer, "--train-size", str(train)]
        argv += ["--eval-size", str(eval_), "--seed", "0", "--num-proc", str(workers)]
        argv += shlex.split(args.extra)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if cli_main(argv) != 0:
                raise SystemExit(f"prepare-data failed: {argv}\n{err.getvalue()[-2000:]}")
        return _phases(err.getvalue())

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:  # warm-up: imports, tokenizer, a pool start
        warm = Path(tmp) / "warm.jsonl"
        with open(args.input, "rb") as f, open(warm, "wb") as w:
            w.writelines(itertools.islice(f, 600))
        call(str(warm), Path(tmp) / "out", 2, 500, 50)
    best: dict[int, float] = {}
    outputs_seen: list[dict] = []  # the output files' hashes of every run: the same for any worker count
    for repeat in range(args.repeats):
        for workers in args.num_proc:
            with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
                out = Path(tmp) / "out"
                memory = PeakMemory()
                cpu0, load, start = _cpu(), os.getloadavg()[0], time.perf_counter()
                phases = call(args.input, out, workers, int(rows * 0.9), int(rows * 0.05))
                wall, cpu1, peak = time.perf_counter() - start, _cpu(), memory.stop()
                manifest = json.loads((out / "manifest.json").read_text())
                outputs = {name: entry["sha256"][:16] for name, entry in manifest["outputs"].items()}
            best[workers] = min(best.get(workers, wall), wall)
            outputs_seen.append(outputs)
            record = {"bench": "prepare", "rows": rows, "num_proc": workers, "repeat": repeat, "wall_s": round(wall, 2)}
            record |= {"rows_per_s": round(rows / wall), "cpu_main_s": round(cpu1[0] - cpu0[0], 1)}
            record |= {"cpu_workers_s": round(cpu1[1] - cpu0[1], 1), "main_peak_mib": peak}
            record |= {"workers_max_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}
            record |= {"phases_s": phases, "load_before": load, "outputs": outputs, "env": env if repeat == 0 else None}
            _emit(args.results, record)
    print(f"SAME_OUTPUTS {len({json.dumps(o, sort_keys=True) for o in outputs_seen}) == 1} ({len(outputs_seen)} runs)")
    base = best[args.num_proc[0]]
    for workers in args.num_proc:
        ratio = base / best[workers]
        print(
            f"RATIO best-of-{args.repeats}: {workers} workers = {ratio:.2f}x {args.num_proc[0]} worker(s) "
            f"({rows} rows: {best[workers]:.1f} s, {rows / best[workers]:.0f} rows/s)"
        )


def _phases(stderr: str) -> dict[str, float]:
    """The seconds of each phase from prepare-data's last stderr line (``tokenised N rows in T s ...; split in S s;
    wrote the splits in W s``); the bars before it are tqdm's, rate-limited (a negligible cost)."""
    import re

    found = re.search(r"rows in ([0-9.]+) s .*split in ([0-9.]+) s; wrote the splits in ([0-9.]+) s", stderr)
    if found is None:
        raise SystemExit(f"prepare-data printed no phase times: {stderr[-500:]!r}")
    return dict(zip(("tokenise", "split", "write"), map(float, found.groups()), strict=True))


# ------------------------------------------------------------------------------------------------ trainer (2 ranks)


class PeakMemory:
    """Samples this process's ``/proc/self/status`` every 50 ms: the peaks of VmRSS, RssAnon and RssFile (MiB)."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self) -> None:
        self.peak = dict.fromkeys(self.FIELDS, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        now = {}
        for line in open("/proc/self/status"):
            name = line.split(":")[0]
            if name in self.FIELDS:
                now[name] = int(line.split()[1]) / 1024
        for name, value in now.items():
            self.peak[name] = max(self.peak[name], value)
        return now

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.sample()

    def reset(self) -> None:
        self.peak = self.sample()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {name: round(value, 1) for name, value in self.peak.items()}


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def trainer_worker(args: argparse.Namespace) -> None:
    """One rank: build the trainer on the raw pairs, train, report memory and CPU per phase."""
    memory = PeakMemory()
    import datasets

    from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
    from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir

    rank = int(os.environ["RANK"])
    memory.reset()
    base = dict(memory.peak)
    raw = datasets.Dataset.from_file(args.raw, in_memory=False)
    config = PairDPOConfig(
        output_dir=str(Path(args.out) / "run"),
        ref_model_revision=DEMO_REVISION,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_length=1024,
        max_prompt_length=512,
        dataset_num_proc=args.num_proc,
        dataset_cache_dir=args.cache,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    model = str(bundled_model_dir())
    cpu0, wall0 = _cpu(), time.perf_counter()
    trainer = PairDPOTrainer(model=model, args=config, train_dataset=raw)
    cpu1, wall1 = _cpu(), time.perf_counter()
    build_peak = dict(memory.peak)
    trainer.train()
    cpu2, wall2 = _cpu(), time.perf_counter()
    peak = memory.stop()
    meta_file = Path(trainer.train_dataset.cache_files[0]["filename"]).parent / "meta.json"
    record = {
        "bench": "trainer",
        "rank": rank,
        "pid": os.getpid(),
        "pairs": len(raw),
        "num_proc": args.num_proc,
        "baseline_mib": base,
        "build_peak_mib": build_peak,
        "run_peak_mib": peak,
        "build_wall_s": round(wall1 - wall0, 1),
        "build_cpu_self_s": round(cpu1[0] - cpu0[0], 1),
        "build_cpu_workers_s": round(cpu1[1] - cpu0[1], 1),
        "train_wall_s": round(wall2 - wall1, 1),
        "train_cpu_s": round(cpu2[0] - cpu1[0], 1),
        "cache_created_by_pid": json.loads(meta_file.read_text())["created_by"]["pid"],
        "files_hashed": trainer.reference_source.files_hashed,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))


def trainer(args: argparse.Namespace) -> None:
    env = _environment()
    for pairs in args.pairs:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            raw = Path(tmp) / "raw.arrow"
            make_input(argparse.Namespace(rows=pairs, tokens=args.tokens, seed=0, out=str(raw), arrow=True))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
            cmd += [str(args.port), __file__, "trainer-worker", "--raw", str(raw), "--out", tmp, "--cache"]
            cmd += [str(Path(tmp) / "cache"), "--num-proc", str(args.num_proc), "--steps", str(args.steps)]
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # carried wheels
            worker_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
            start, load = time.perf_counter(), os.getloadavg()[0]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env)
            if proc.returncode != 0:
                raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
            for rank in (0, 1):
                record = json.loads(Path(tmp, f"rank{rank}.json").read_text())
                record |= {"tokens": args.tokens, "load_before": load, "job_wall_s": round(time.perf_counter() - start)}
                _emit(args.results, {**record, "env": env})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="bench_data_scale.jsonl")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-input")
    make.add_argument("--rows", type=int, required=True)
    make.add_argument("--tokens", type=int, default=None, help="Tokens per pair (default: the demo's short rows).")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True)
    make.add_argument("--arrow", action="store_true", help="An Arrow stream file (datasets.Dataset.from_file).")
    prep = sub.add_parser("prepare")
    prep.add_argument("--input", required=True)
    prep.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    prep.add_argument("--repeats", type=int, default=3)
    prep.add_argument("--tmp", default=None, help="Where the outputs are written (and removed).")
    prep.add_argument("--extra", default="", help='More prepare-data arguments, one string: "--max-length 512".')
    train = sub.add_parser("trainer")
    train.add_argument("--pairs", type=int, nargs="+", default=[1000, 1_000_000])
    train.add_argument("--tokens", type=int, default=800)
    train.add_argument("--num-proc", type=int, default=2)
    train.add_argument("--steps", type=int, default=3)
    train.add_argument("--port", type=int, default=29561)
    train.add_argument("--tmp", default=None)
    worker = sub.add_parser("trainer-worker")
    worker.add_argument("--raw", required=True)
    worker.add_argument("--out", required=True)
    worker.add_argument("--cache", required=True)
    worker.add_argument("--num-proc", type=int, required=True)
    worker.add_argument("--steps", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    {"make-input": make_input, "prepare": prepare, "trainer": trainer, "trainer-worker": trainer_worker}[args.command](
        args
    )


if __name__ == "__main__":
    main()
