"""``benchmarks.bench_data_scale``: the rows it generates have the asked size and shape."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from benchmarks import bench_data_scale
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, tokenize_dataset
from pair_dpo_trainer.demo import bundled_model_dir


def test_the_benchmark_rows_have_the_asked_number_of_tokens(tmp_path):
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    out = tmp_path / "rows.jsonl"
    argv = ["--results", str(tmp_path / "r.jsonl"), "make-input", "--rows", "20", "--tokens", "300", "--out", str(out)]
    bench_data_scale.main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20 and len({r["prompt"] for r in rows}) == 20
    features = tokenize_dataset(rows, tok, max_length=1024, max_prompt_length=512, strict=True).features
    tokens = [sum(len(f[c]) for c in FEATURE_COLUMNS) for f in features]
    assert all(300 <= n <= 320 for n in tokens), tokens  # + the template's few tokens and the row number
    for shape in (None, 30):  # the fast JSON lines are json.dumps of the rows, past the pool's 4096 rows too
        lines = list(bench_data_scale.iter_json_lines(5000, shape))
        assert lines == [json.dumps(r) + "\n" for r in bench_data_scale.iter_rows(5000, shape)]
