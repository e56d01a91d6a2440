"""The GPU-run helpers of docs/zero3_howto.md on a tiny scale: a random pinned snapshot, and the loss-curve overlay."""

from __future__ import annotations

import json

from benchmarks.tools import loss_curves as plot_loss_curves
from benchmarks.tools import random_model as make_random_model
from pair_dpo_trainer.integrity import verify_snapshot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--hidden", "32", "--layers", "1", "--intermediate", "64", "--heads", "2"]


def test_random_model_is_a_verifiable_deterministic_snapshot(tmp_path, capsys):
    assert make_random_model.main(["--out", str(tmp_path / "a"), *TINY]) == 0
    revision = capsys.readouterr().out.strip().splitlines()[-1]
    snapshot = verify_snapshot(tmp_path / "a", revision)
    assert "model.safetensors" in snapshot.digests and "tokenizer.json" in snapshot.digests
    assert make_random_model.main(["--out", str(tmp_path / "b"), *TINY]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == revision  # same arguments, same bytes
    assert make_random_model.main(["--out", str(tmp_path / "a"), *TINY]) == 2  # never overwrites


def test_loss_curves_overlay_reports_the_largest_difference(tmp_path, capsys):
    for name, offset in (("a", 0.0), ("b", 1e-3)):
        history = [{"step": s, "loss": 0.7 - 0.01 * s + (offset if s == 3 else 0.0)} for s in range(1, 6)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    out = tmp_path / "img" / "cmp.png"
    code = plot_loss_curves.main([str(tmp_path / "a"), str(tmp_path / "b" / "trainer_state.json"), "--out", str(out)])
    assert code == 0 and out.read_bytes()[:8] == PNG_MAGIC
    assert "1.000e-03" in capsys.readouterr().out
    assert plot_loss_curves.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
