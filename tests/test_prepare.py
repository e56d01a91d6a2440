"""``pair-dpo prepare-data``: formats, determinism, prompt-disjoint splits, exit 2 without partial output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pytest

from pair_dpo_trainer.cli import main
from pair_dpo_trainer.data.normalize import normalize_row, prompt_hash
from pair_dpo_trainer.data.prepare import Candidate, select_split
from pair_dpo_trainer.data.tokenize import tokenize_pair
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.demo.pairs import generate_demo_pairs

OUTPUTS = ["eval.arrow", "eval.jsonl", "manifest.json", "train.arrow", "train.jsonl"]


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    return str(bundled_model_dir())


@pytest.fixture(scope="session")
def demo_rows() -> list[dict]:
    return generate_demo_pairs(seed=3, n=60)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _rows_with_duplicates_and_errors(demo_rows: list[dict]) -> list:
    """60 distinct prompts, 15 more pairs repeating 5 of them (answers swapped), then 4 bad rows."""
    rows: list = list(demo_rows)
    for i in range(15):
        row = demo_rows[i % 5]
        rows.append({**row, "chosen": row["rejected"], "rejected": row["chosen"]})
    rows += [
        {"prompt": "x"},
        ["not", "an", "object"],
        {"prompt": "x", "chosen": " 1", "rejected": " 1"},
        {"prompt": "x", "chosen": [{"role": "bot", "content": "1"}], "rejected": "2"},
    ]
    return rows


def _prepare(inputs, out, tokenizer_dir, *extra: str, train=40, eval_=10, seed=7) -> int:
    argv = [
        "prepare-data",
        *map(str, inputs),
        "--output",
        str(out),
        "--tokenizer",
        tokenizer_dir,
        "--train-size",
        str(train),
        "--eval-size",
        str(eval_),
        "--seed",
        str(seed),
        *extra,
    ]
    return main(argv)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _assert_no_leftovers(out: Path) -> None:
    assert not out.exists()
    if out.parent.exists():
        assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.integration
def test_outputs_manifest_and_disjoint_prompts(tmp_path, tokenizer_dir, demo_rows, capsys):
    source = _write_jsonl(tmp_path / "in.jsonl", _rows_with_duplicates_and_errors(demo_rows))
    out = tmp_path / "out"
    assert _prepare([source], out, tokenizer_dir, "--max-length", "128", "--max-prompt-length", "64") == 0
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    train, eval_ = _read_jsonl(out / "train.jsonl"), _read_jsonl(out / "eval.jsonl")
    assert len(train) == 40 and len(eval_) == 10
    train_hashes, eval_hashes = {r["prompt_hash"] for r in train}, {r["prompt_hash"] for r in eval_}
    assert not train_hashes & eval_hashes
    for row in train + eval_:
        pair = normalize_row(row)  # output rows are shape-2 rows again
        assert prompt_hash(pair) == row["prompt_hash"]
        tokens = tokenize_pair(pair, _tokenizer(tokenizer_dir), max_length=128, max_prompt_length=64)
        assert tokens.to_features() == {k: row[k] for k in tokens.to_features()}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "in.jsonl", "rows": 79, "sha256": _sha(source)}]
    assert manifest["accepted"] == 75 and manifest["rows_read"] == 79
    assert manifest["rejections"] == {"identical_after_truncation": 1, "role": 1, "schema": 2}
    assert (manifest["seed"], manifest["train_size"], manifest["eval_size"]) == (7, 40, 10)
    assert (manifest["max_length"], manifest["max_prompt_length"]) == (128, 64)
    assert manifest["tokenizer"]["name"] == "tiny-llama"
    assert manifest["tokenizer"]["tokenizer_json_sha256"] == _sha(bundled_model_dir() / "tokenizer.json")
    assert manifest["package"]["version"]
    for name in ("train.jsonl", "eval.jsonl", "train.arrow", "eval.arrow"):
        assert manifest["outputs"][name]["sha256"] == _sha(out / name)
    assert str(tmp_path) not in (out / "manifest.json").read_text()
    assert "accepted 75" in capsys.readouterr().out


@pytest.mark.integration
def test_byte_identical_reruns(tmp_path, tokenizer_dir, demo_rows, monkeypatch):
    source = _write_jsonl(tmp_path / "in.jsonl", _rows_with_duplicates_and_errors(demo_rows))
    assert _prepare([source], tmp_path / "a", tokenizer_dir) == 0
    monkeypatch.chdir(tmp_path)  # relative paths this time: nothing path-dependent may leak into the outputs
    assert _prepare(["in.jsonl"], "b", tokenizer_dir) == 0
    for name in OUTPUTS:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert _prepare(["in.jsonl"], "c", tokenizer_dir, seed=8) == 0
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()


def test_jsonl_json_and_parquet_inputs(tmp_path, tokenizer_dir, demo_rows):
    jsonl = _write_jsonl(
        tmp_path / "a.jsonl",
        [
            {
                "prompt": r["prompt"][0]["content"],
                "chosen": r["chosen"][0]["content"],
                "rejected": r["rejected"][0]["content"],
            }
            for r in demo_rows[:20]
        ],
    )
    as_json = tmp_path / "b.json"
    as_json.write_text(
        json.dumps(
            [
                {
                    key: f"\n\nHuman: {r['prompt'][0]['content']}\n\nAssistant: {r[key][0]['content']}"
                    for key in ("chosen", "rejected")
                }
                for r in demo_rows[20:40]
            ]
        )
    )
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_list(demo_rows[40:60]).to_parquet(str(parquet))
    out = tmp_path / "out"
    assert _prepare([jsonl, as_json, parquet], out, tokenizer_dir, train=45, eval_=15) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(i["name"], i["rows"]) for i in manifest["inputs"]] == [
        ("a.jsonl", 20),
        ("b.json", 20),
        ("c.parquet", 20),
    ]
    assert manifest["accepted"] == 60 and manifest["rejections"] == {}
    rows = _read_jsonl(out / "train.jsonl") + _read_jsonl(out / "eval.jsonl")
    assert {r["source"] for r in rows} == {"a.jsonl", "b.json", "c.parquet"}
    assert len({r["prompt_hash"] for r in rows}) == 60


def test_overwrite_replaces_a_previous_output(tmp_path, tokenizer_dir, demo_rows, capsys):
    source = _write_jsonl(tmp_path / "in.jsonl", demo_rows)
    out = tmp_path / "out"
    assert _prepare([source], out, tokenizer_dir) == 0
    assert _prepare([source], out, tokenizer_dir, train=30) == 2  # not empty, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert _prepare([source], out, tokenizer_dir, "--overwrite", train=30) == 0
    assert len(_read_jsonl(out / "train.jsonl")) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]


@pytest.mark.parametrize(
    "case,extra,sizes,message",
    [
        ("too-few", (), (55, 10), "only 60 valid pairs"),
        ("missing-file", (), (10, 5), "no such file"),
        ("corrupt-parquet", (), (10, 5), "cannot read"),
        ("invalid-json-strict", ("--strict",), (10, 5), "[bad_json] in.jsonl row 1: line 1 is not valid JSON"),
        ("unsupported-format", (), (10, 5), "unsupported input format"),
        ("negative-eval", (), (10, -1), "--eval-size"),
        (
            "prompt-too-long",
            ("--max-length", "32", "--max-prompt-length", "32"),
            (10, 5),
            "--max-prompt-length",
        ),
        ("bad-tokenizer", (), (10, 5), "--tokenizer"),
        ("shared-prompt", (), (2, 1), "distinct prompts"),
        ("strict", ("--strict",), (10, 5), "[schema] in.jsonl row 61:"),  # the 61st row: numbered from 1
    ],
)
def test_errors_exit_2_without_partial_output(tmp_path, tokenizer_dir, demo_rows, capsys, case, extra, sizes, message):
    source = _write_jsonl(tmp_path / "in.jsonl", demo_rows)
    tokenizer = tokenizer_dir
    if case == "missing-file":
        source = tmp_path / "missing.jsonl"
    elif case == "corrupt-parquet":
        source = tmp_path / "bad.parquet"
        source.write_bytes(b"PAR1 not really parquet")
    elif case == "invalid-json-strict":
        source.write_text('{"prompt": "x", "chosen": \n')
    elif case == "unsupported-format":
        source = source.rename(tmp_path / "in.csv")
    elif case == "bad-tokenizer":
        tokenizer = str(tmp_path)
    elif case == "shared-prompt":
        _write_jsonl(source, [{**demo_rows[0], "chosen": r["chosen"], "rejected": r["rejected"]} for r in demo_rows])
    elif case == "strict":
        _write_jsonl(source, [*demo_rows, {"prompt": "x"}])
    out = tmp_path / "nested" / "out"
    assert _prepare([source], out, tokenizer, *extra, "--disable-tqdm", train=sizes[0], eval_=sizes[1]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pair-dpo prepare-data: error: ") and message in err
    _assert_no_leftovers(out)


def test_argparse_errors_exit_2(tmp_path, tokenizer_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "prepare-data",
                "in.jsonl",
                "--output",
                str(tmp_path / "out"),
                "--tokenizer",
                tokenizer_dir,
                "--train-size",
                "ten",
                "--eval-size",
                "1",
                "--seed",
                "0",
            ]
        )
    assert info.value.code == 2 and "--train-size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["prepare-data", "in.jsonl", "--output", str(tmp_path / "out")])
    assert info.value.code == 2
    _assert_no_leftovers(tmp_path / "out")


def test_select_split_keeps_prompt_groups_whole_and_fills_exactly():
    def candidate(prompt: str, i: int) -> Candidate:
        pair = normalize_row({"prompt": prompt, "chosen": str(i), "rejected": "x"})
        return Candidate("in.jsonl", i, pair, {}, prompt_hash(pair))

    rows = [candidate("big", i) for i in range(5)] + [candidate("small", 5)]
    for seed in range(6):
        split = select_split(rows, train_size=5, eval_size=1, seed=seed)
        assert [c.row for c in split.eval] == [5] and [c.row for c in split.train] == [0, 1, 2, 3, 4]
    short = select_split(rows, train_size=2, eval_size=2, seed=0)
    assert len(short.eval) + len(short.train) < 4  # the big prompt group cannot feed both splits


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


@pytest.mark.integration
@pytest.mark.parametrize("share_prompt", [False, True], ids=["unshared", "shared-prompt"])
def test_max_tokens_per_microbatch_rejects_pairs_over_the_budget(
    tmp_path, tokenizer_dir, demo_rows, capsys, share_prompt
):
    """The budget counts the layout named: ``--share-prompt`` admits by prompt + chosen + rejected."""
    source = _write_jsonl(tmp_path / "in.jsonl", demo_rows)
    tok = _tokenizer(tokenizer_dir)
    pairs = [tokenize_pair(normalize_row(r), tok, max_length=1024, max_prompt_length=512) for r in demo_rows]
    costs = sorted(p.cost - (len(p.prompt_ids) if share_prompt else 0) for p in pairs)
    budget = costs[len(costs) // 2]  # about half the pairs cost more
    out = tmp_path / "out"
    flags = ["--max-tokens-per-microbatch", str(budget)] + (["--share-prompt"] if share_prompt else [])
    code = _prepare([source], out, tokenizer_dir, *flags, train=10, eval_=2)
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["max_tokens_per_microbatch"] == budget and manifest["budget_share_prompt"] is share_prompt
    assert manifest["rejections"]["pair_too_long"] == sum(c > budget for c in costs) > 0
    assert "pair_too_long" in capsys.readouterr().out


def test_a_malformed_json_line_is_one_bad_json_row_with_its_line_number(tmp_path, tokenizer_dir, demo_rows, capsys):
    """One bad line never aborts the file (``--strict`` does): it is counted as ``bad_json`` and named by its line."""
    lines = [json.dumps(row) for row in demo_rows]
    lines.insert(4, '{"prompt": "x", "chosen": ')  # line 5 of the file
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert _prepare([source], tmp_path / "out", tokenizer_dir, "--disable-tqdm") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["rejections"] == {"bad_json": 1} and manifest["accepted"] == 60
    out = capsys.readouterr().out
    assert "[bad_json] in.jsonl row 5: line 5 is not valid JSON" in out


def test_only_inputs_output_and_tokenizer_are_required(tmp_path, tokenizer_dir, demo_rows, capsys):
    """Defaults: every valid pair is train, none held out, seed 42 (the trainer's), and the prompt limit by the
    trainer's rule (``--max-length 128`` alone: 64)."""
    source = _write_jsonl(tmp_path / "in.jsonl", demo_rows)
    argv = ["prepare-data", str(source), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_dir]
    assert main([*argv, "--max-length", "128", "--disable-tqdm"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["max_length"], manifest["max_prompt_length"]) == (128, 64)
    assert (manifest["train_size"], manifest["eval_size"], manifest["seed"]) == (60, 0, 42)
    assert manifest["splits"]["eval"]["pairs"] == 0 and len(_read_jsonl(tmp_path / "out" / "train.jsonl")) == 60
    assert "wrote 60 train + 0 eval pairs" in capsys.readouterr().out


def test_every_message_is_a_whole_line(tmp_path, tokenizer_dir, demo_rows, capfd):
    """Success and error alike: what prepare-data prints ends with a newline, also after a progress bar."""
    source = _write_jsonl(tmp_path / "in.jsonl", [*demo_rows, {"prompt": "x"}])
    assert _prepare([source], tmp_path / "ok", tokenizer_dir) == 0
    assert _prepare([source], tmp_path / "strict", tokenizer_dir, "--strict") == 2
    captured = capfd.readouterr()
    for stream in (captured.out, captured.err):
        assert stream.endswith("\n")
    assert "\npair-dpo prepare-data: error: [schema]" in "\n" + captured.err.replace("\r", "\n")
