"""CPU tests of the benchmarks' model shapes and memory / precision options: the Qwen2-1.5B shape and its tiny variant,
MFU parameter counts with a tied head, ``benchmarks.dpo``'s ``--lora`` / ``--gradient-checkpointing`` /
``--activation-checkpointing`` / ``--activation-offload`` / ``--fp8`` and ``benchmarks.trl_dpo``'s ``--liger`` /
``--lora`` / ``--gradient-checkpointing`` (liger cannot run on the CPU: its plumbing only), and
``benchmarks.alloc_check``."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import TrainingArguments

from benchmarks import alloc_check, trl_dpo, workload
from benchmarks.rows import param_counts


@pytest.fixture(scope="module")
def bench():
    from benchmarks import dpo

    return dpo


def _meta_model(size: str) -> torch.nn.Module:
    """The model of a size without memory (parameters on the meta device)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    with torch.device("meta"):
        return (Qwen2ForCausalLM if size in workload.QWEN2 else LlamaForCausalLM)(workload.model_config(size))


def test_qwen_shape_is_qwen2_1p5b_with_a_tied_head_counted_once():
    dims = workload.model_dims("qwen1.5b")
    assert {k: dims[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")} == {
        "hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960, "vocab_size": 151936,
    }  # fmt: skip
    assert (dims["num_attention_heads"], dims["num_key_value_heads"], dims["tie_word_embeddings"]) == (12, 2, True)
    model = _meta_model("qwen1.5b")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert all(getattr(attn, f"{x}_proj").bias is not None for x in "qkv") and attn.o_proj.bias is None
    n_all, n_matmul = param_counts(model)
    assert n_all == n_matmul == 1_543_714_304  # Qwen2-1.5B; the tied head's matmul counted once, nothing subtracted
    n_all, n_matmul = param_counts(_meta_model("8b"))  # untied: the input embedding (a lookup) is not counted
    assert n_all - n_matmul == 128256 * 4096 and n_all == 8_030_261_248


def test_tiny_qwen_draws_ids_below_its_vocabulary_and_the_others_keep_the_workload_ids():
    assert workload.token_vocab("tiny-qwen") == 512 and workload.token_vocab("qwen1.5b") == workload.VOCAB
    for mix in ("trl", "heavy"):
        pairs = workload.make_pairs(20, seed=0, mix=mix, vocab=512)
        assert max(max(r[k]) for r in pairs for k in r) < 512
        assert workload.make_pairs(3, 0, mix) == workload.make_pairs(3, 0, mix, vocab=workload.VOCAB)
    model = workload.build_model("tiny-qwen", seed=0)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.get_input_embeddings().num_embeddings == 512


def test_option_flags_parse_and_refuse_bad_combinations(bench):
    args = bench.parse_args(["--tiny", "--model-size", "tiny-qwen", "--lora", "8", "--gradient-checkpointing"])
    assert (args.model_size, args.lora, args.gradient_checkpointing) == ("tiny-qwen", 8, True)
    assert bench.parse_args(["--tiny", "--model-size", "8b"]).model_size == "tiny"  # --tiny keeps a tiny size only
    for mode in ("off", "full", "selective", "auto", "layers:3"):
        assert bench.parse_args(["--activation-checkpointing", mode]).activation_checkpointing == mode
    bad = (
        ["--activation-checkpointing", "layers:0"],
        ["--activation-checkpointing", "every2"],
        ["--gradient-checkpointing", "--activation-checkpointing", "full"],
        ["--lora", "0"],
        ["--fp8", "mxfp8"],
    )
    for argv in bad:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_gradient_checkpointing_is_hf_non_reentrant_and_the_new_options_reach_the_config(bench):
    args = bench.parse_args(["--tiny", "--gradient-checkpointing"])
    config = bench.build_config(args, 1, 3, bf16=False)
    assert config.gradient_checkpointing and config.gradient_checkpointing_kwargs == {"use_reentrant": False}
    fields = bench.trainer_fields()
    assert "max_length" in fields and "activation_checkpointing" not in bench.trainer_fields(TrainingArguments)
    argv = ["--tiny", "--activation-checkpointing", "layers:2", "--activation-offload", "--fp8", "rowwise"]
    config = bench.build_config(bench.parse_args(argv), 1, 3, bf16=False)
    assert (config.activation_checkpointing_mode, config.activation_offload, config.fp8) == (
        "layers:2",
        True,
        "rowwise",
    )


def test_the_new_options_pass_only_when_given_and_fp8_needs_torchao(bench, monkeypatch):
    """The flags given become keyword arguments, the flags left out pass nothing (the config's defaults run)."""
    fields = bench.trainer_fields()
    assert {"fp8", "activation_checkpointing_mode", "activation_offload"} <= fields
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object())  # torchao "installed"
    argv = ["--activation-checkpointing", "layers:2", "--activation-offload", "--fp8", "tensorwise"]
    argv += ["--tiled-mlp", "512"]
    assert bench.new_option_kwargs(bench.parse_args(argv), fields) == {
        "activation_checkpointing_mode": "layers:2", "activation_offload": True, "fp8": "tensorwise",
        "tiled_mlp": "512",
    }  # fmt: skip
    assert bench.new_option_kwargs(bench.parse_args([]), fields) == {}
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="torchao"):
        bench.new_option_kwargs(bench.parse_args(["--fp8", "rowwise"]), fields)


def test_tiny_qwen_lora_with_gradient_checkpointing_runs_and_records_its_options(bench, tmp_path, monkeypatch):
    """``--lora`` on the tied-head Qwen2 variant: the reference is the adapter-disabled policy (no copy), HF
    checkpointing is on the model, every row (the ceiling's too) carries the options."""
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--model-size", "tiny-qwen", "--lora", "4", "--gradient-checkpointing", "--bs", "1"]
    row = bench.main([*argv, "--steps", "1", "--warmup", "1", "--ceiling", "--tag", "lora_gc"])
    assert row["model_size"] == "tiny-qwen" and row["lora_r"] == 4 and row["gradient_checkpointing"] is True
    assert row["reference_backend"] == "AdapterDisabledReference" and row["hf_checkpointing_on_model"] is True
    assert 0 < row["n_params_trainable"] < row["n_params"] == row["n_params_no_embed"]  # tied head: counted
    assert row["activation_checkpointing"] is None and row["fp8"] is None and row["real_tok_s_gpu"] > 0
    ceiling = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    assert ceiling["impl"] == "pair_dpo_ceiling" and ceiling["lora_r"] == 4 and ceiling["real_tok_s_gpu"] > 0


def test_trl_options_reach_dpo_config_and_the_row(monkeypatch):
    args = trl_dpo.parse_args(
        ["--tiny", "--model-size", "tiny-qwen", "--liger", "--lora", "4", "--gradient-checkpointing"]
    )
    kwargs = trl_dpo.dpo_config_kwargs(args, cuda=False)
    assert kwargs["use_liger_kernel"] is True and kwargs["gradient_checkpointing"] is True
    assert "use_liger_kernel" not in trl_dpo.dpo_config_kwargs(trl_dpo.parse_args(["--tiny"]), cuda=False)
    assert args.model_size == "tiny-qwen" and args.lora == 4
    lora = workload.lora_config(4)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8, 0.0)
    assert set(lora.target_modules) == set(workload.LORA_TARGETS)


def test_trl_liger_without_liger_says_why_and_exits(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # an import of it raises ImportError
    problem = trl_dpo.liger_problem()
    assert problem is not None and "liger_kernel" in problem and "pip install liger-kernel" in problem
    monkeypatch.setattr(trl_dpo, "trl_available", lambda: True)
    assert trl_dpo.main(["--tiny", "--liger", "--tag", "lig"]) == trl_dpo.LIGER_MISSING
    assert "LIGER_MISSING lig: --liger needs liger_kernel" in capsys.readouterr().out


@pytest.mark.skipif(not trl_dpo.trl_available(), reason="needs trl and datasets")
def test_trl_tiny_qwen_lora_with_gradient_checkpointing_runs(tmp_path):
    results = tmp_path / "r.jsonl"
    argv = ["--tiny", "--model-size", "tiny-qwen", "--lora", "4", "--gradient-checkpointing", "--bs", "1"]
    assert trl_dpo.main([*argv, "--steps", "1", "--warmup", "1", "--workers", "0", "--results", str(results)]) == 0
    row = json.loads(results.read_text())
    assert row["lora_r"] == 4 and row["gradient_checkpointing"] is True and row["hf_checkpointing_on_model"] is True
    assert row["trl_liger"] is False and row["liger_modules"] == 0 and row["reference_backend"] == "adapter_disabled"
    assert 0 < row["n_params_trainable"] < row["n_params"] == row["n_params_no_embed"]
    assert row["mfu_noembed_989"] >= 0 and row["real_tok_s_gpu"] > 0


@pytest.mark.integration
def test_alloc_check_trains_through_the_library_api_and_records_the_allocator(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    results = tmp_path / "a.jsonl"
    row = alloc_check.main(["--tiny", "--pairs", "1", "--steps", "1", "--mix", "trl", "--results", str(results)])
    assert row["impl"] == "alloc_check" and row["steps"] == 1 and row["bs_pairs"] == 1
    assert set(row["alloc_env_at_start"]) == set(alloc_check.ALLOC_VARS) and row["target"] == 1.15
    assert row["peak_alloc_gib"] is None and row["target_met"] is None  # no CUDA here
    assert json.loads(results.read_text())["tag"] == "alloc_check" and "RESULT {" in capsys.readouterr().out
