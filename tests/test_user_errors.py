"""Every error class a user can trigger carries a reason code and names what to change (the option, file or row)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.demo.pairs import generate_demo_pairs
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError, ScheduleError
from pair_dpo_trainer.modeling import attention
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer
from tests.multinode import namespaces_available


def _config(tmp_path: Path, **kwargs) -> PairDPOConfig:
    return cpu_config(tmp_path, **kwargs)


# ------------------------------------------------------------------------------------------------ configuration


# Configuration values: tests/test_config.py (every code, field=value in the message, all problems at once).


# ------------------------------------------------------------------------------------------------ data files


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, text the error must contain besides the path)."""
    parquet = tmp_path / "corrupt.parquet"
    parquet.write_bytes(b"PAR1 not really parquet")
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'\xff{"prompt": "caf\xe9"}\n')
    return {
        "missing": (tmp_path / "missing.jsonl", "no such file"),
        "parquet": (parquet, "parquet"),
        "encoding": (latin, "UTF-8"),
    }


@pytest.mark.parametrize("name", ["missing", "parquet", "encoding"])  # a malformed JSON line is one bad row
def test_prepare_data_on_an_unreadable_file_exits_2_naming_the_file(tmp_path, capsys, name):
    path, detail = _bad_inputs(tmp_path)[name]
    output = tmp_path / "prepared"
    args = ["prepare-data", str(path), "--output", str(output), "--tokenizer", str(bundled_model_dir())]
    code = cli_main([*args, "--train-size", "1", "--eval-size", "0", "--seed", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(path) in err and detail in err
    assert not output.exists()  # no partial output


# ------------------------------------------------------------------------------------------------ snapshots


def _verify(path: Path, revision: str = DEMO_REVISION) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pair_dpo_trainer.cli", "verify-snapshot", str(path), "--revision", revision]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_verify_snapshot_rejects_a_tampered_copy_with_code_and_path(tmp_path):
    snapshot = tmp_path / "tiny-llama"
    shutil.copytree(bundled_model_dir(), snapshot)
    assert _verify(snapshot).returncode == 0  # the untouched copy verifies

    config = snapshot / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 4', '"num_hidden_layers": 3'))
    done = _verify(snapshot)
    assert done.returncode == 1
    assert "[hash_mismatch]" in done.stdout and "config.json" in done.stdout

    (snapshot / "extra.safetensors").write_bytes(b"not from the commit")
    done = _verify(snapshot)
    assert done.returncode == 1
    assert "[metadata_missing]" in done.stdout and "extra.safetensors" in done.stdout


def test_verify_snapshot_refuses_a_branch_name(tmp_path):
    done = _verify(bundled_model_dir(), revision="main")
    assert done.returncode == 1
    assert "[revision_not_pinned]" in done.stdout and "'main'" in done.stdout


# ------------------------------------------------------------------------------------------------ optional dependencies


def test_flash_attn_backend_without_cuda_is_a_config_error_naming_the_way_out(tmp_path):
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(
            model=tiny_llama(0),
            args=_config(tmp_path, attn_backend="flash_attn"),
            train_dataset=synthetic_pairs(8),
            processing_class=tiny_tokenizer(),
        )
    assert info.value.reason_code == "attn_backend_unavailable"
    assert "flash_attn" in str(info.value) and "'auto'" in str(info.value)


def _flash_attn_not_installed_error(monkeypatch) -> ConfigError:
    """The error of ``attn_backend='flash_attn'`` on a CUDA device when the flash_attn package does not import."""
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", lambda: None)
    with pytest.raises(ConfigError) as info:
        attention.select_attn_backend("flash_attn", device="cuda", dtype=torch.bfloat16)
    return info.value


def test_flash_attn_not_installed_is_a_config_error(monkeypatch):
    error = _flash_attn_not_installed_error(monkeypatch)
    assert error.reason_code == "attn_backend_unavailable"
    assert "flash_attn" in str(error) and "'auto'" in str(error)


def test_flash_attn_not_installed_names_the_option_and_the_install(monkeypatch):
    message = str(_flash_attn_not_installed_error(monkeypatch))
    assert "attn_backend" in message and "pip install" in message


# ------------------------------------------------------------------------------------------------ dataset rows


@pytest.mark.parametrize(
    "bad_row,code,names",
    [
        ({"prompt": "2+2?", "chosen": "4"}, "schema", "'rejected'"),
        ({"prompt": [{"role": "human", "content": "hi"}], "chosen": "a", "rejected": "b"}, "role", "prompt[0].role"),
        ({"prompt": "2+2?", "chosen": "4", "rejected": "4"}, "identical_after_truncation", "identical"),
    ],
)
def test_malformed_row_in_the_trainer_dataset_names_the_row(tmp_path, bad_row, code, names):
    rows = [*generate_demo_pairs(seed=1, n=3), bad_row, *generate_demo_pairs(seed=2, n=2)]
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(
            model=tiny_llama(0),
            args=_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1),
            train_dataset=rows,
            processing_class=AutoTokenizer.from_pretrained(bundled_model_dir()),
        )
    assert info.value.reason_code == code
    assert "row 3" in str(info.value) and names in str(info.value)


# ------------------------------------------------------------------------------------------------ schedule


def test_too_few_pairs_for_one_step_names_the_batch_options(tmp_path):
    with pytest.raises(ScheduleError) as info:  # at construction: the row count is enough to know
        PairDPOTrainer(
            model=tiny_llama(0),
            args=_config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1),
            train_dataset=synthetic_pairs(5),
            processing_class=tiny_tokenizer(),
        )
    assert info.value.reason_code == "too_few_pairs"
    assert "per_device_train_batch_size" in str(info.value) and "gradient_accumulation_steps" in str(info.value)


# ------------------------------------------------------------------------------------------------ model paths (13.10)


def _policy_paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (mistyped policy path, what the message says about it)."""
    (tmp_path / "file").write_text("not a model")
    (tmp_path / "empty").mkdir()
    return {
        "absolute": (str(tmp_path / "models" / "typo-policy"), "does not exist"),
        "relative": ("models/typo-policy", "does not exist"),  # also a valid Hub repo id: never looked up
        "file": (str(tmp_path / "file"), "is a file"),
        "no-config": (str(tmp_path / "empty"), "is a directory without config.json"),
    }


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("case", ["absolute", "relative", "file", "no-config"])
def test_a_mistyped_policy_path_is_named_as_the_policy(tmp_path, case, pinned):
    path, detail = _policy_paths(tmp_path)[case]
    pin = {"ref_model_revision": DEMO_REVISION, "allow_unpinned_reference": False} if pinned else {}
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(model=path, args=_config(tmp_path, **pin), train_dataset=synthetic_pairs(8))
    message = info.value.message
    assert info.value.reason_code == "model_not_found"
    assert f"the policy path {path!r} (model) {detail}" in message
    assert "reference" not in message and "Repo id" not in message
    hub = "if it is a Hub name: download it first with a pinned revision (hf download REPO --revision SHA"
    assert (hub in message) == (case == "relative")  # shaped like a Hub repo id: the download step is spelled out


def test_train_script_names_a_mistyped_policy_path(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import train  # the repository's train.py

    typo = str(tmp_path / "models" / "typo")
    with pytest.raises(ConfigError) as info:
        train.main(  # a real run names both the model and the data (train.py: incomplete_arguments otherwise)
            ["--model_name_or_path", typo, "--dataset", str(bundled_pairs_path())]
            + ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true"]
        )
    assert info.value.reason_code == "model_not_found"
    assert f"the policy path {typo!r} (--model_name_or_path) does not exist" in info.value.message


def test_a_mistyped_unpinned_reference_path_is_named_as_the_reference(tmp_path):
    typo = str(tmp_path / "ref-typo")
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(
            model=str(bundled_model_dir()),
            args=_config(tmp_path, ref_model_name_or_path=typo),
            train_dataset=synthetic_pairs(8),
        )
    assert info.value.reason_code == "reference_not_local"
    assert f"the reference path {typo!r} (ref_model_name_or_path) does not exist" in info.value.message


# ------------------------------------------------------------------------------------------------ prepare-data rows


def _prepare_rows(tmp_path: Path, rows: list, *extra: str) -> int:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["prepare-data", str(source), "--output", str(tmp_path / "out"), "--tokenizer", str(bundled_model_dir())]
    return cli_main([*argv, "--train-size", "4", "--eval-size", "0", "--seed", "0", "--disable-tqdm", *extra])


BAD_ROWS = [
    {"prompt": "2+2?", "chosen": "4"},  # row 2: schema (the first one)
    {"prompt": "2+2?", "chosen": "4", "rejected": " "},  # row 3: empty_completion (first by code name)
    {"prompt": [{"role": "user", "content": None}], "chosen": "4", "rejected": "5"},  # row 4: content_type
]


def test_prepare_data_names_the_first_rejection_with_1_based_rows(tmp_path, capsys):
    rows = [generate_demo_pairs(seed=0, n=1)[0], *BAD_ROWS]
    assert _prepare_rows(tmp_path, rows) == 2  # 1 valid pair for 4
    err = capsys.readouterr().err
    assert "First rejection: [schema] in.jsonl row 2: the row has no 'rejected' field" in err


def test_prepare_data_examples_and_strict_errors_count_rows_from_1(tmp_path, capsys):
    rows = [*BAD_ROWS, *generate_demo_pairs(seed=0, n=6)]
    assert _prepare_rows(tmp_path, rows) == 0
    out = capsys.readouterr().out
    assert "e.g. [schema] in.jsonl row 1:" in out and "e.g. [empty_completion] in.jsonl row 2:" in out
    assert "e.g. [content_type] in.jsonl row 3:" in out
    written = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert len(written) == 4 and {r["source_row"] for r in written} <= {4, 5, 6, 7, 8, 9}  # rows 4..9 are valid
    shutil.rmtree(tmp_path / "out")
    assert _prepare_rows(tmp_path, rows, "--strict") == 2
    assert "[schema] in.jsonl row 1:" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ how errors print

ROOT = Path(__file__).resolve().parents[1]


def _script_env(tmp_path: Path, *, debug: bool = False) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
        **({"PAIR_DPO_DEBUG": "1"} if debug else {}),
    }


def _train_command(*argv: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *argv]


def _train_script(tmp_path: Path, *argv: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = _script_env(tmp_path, debug=debug)
    return subprocess.run(_train_command(*argv), capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.integration
def test_train_script_prints_a_reason_coded_error_as_one_message_and_the_traceback_on_request(tmp_path, monkeypatch):
    """The one-line message from a real ``train.py`` process; with ``PAIR_DPO_DEBUG=1`` the error leaves
    ``train.run`` (this process), which is what makes the interpreter print its traceback and exit 1."""
    import train

    typo = str(tmp_path / "models" / "typo")
    argv = ["--model_name_or_path", typo, "--dataset", str(bundled_pairs_path()), "--output_dir", str(tmp_path)]
    done = _train_script(tmp_path, *argv, "--use_cpu", "true")
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 2, done.stderr[-2000:]
    assert lines[0].startswith(f"train.py: error: [model_not_found] the policy path {typo!r} (--model_name_or_path)")
    assert lines[1] == "train.py: (the traceback: set PAIR_DPO_DEBUG=1)"
    assert "Traceback" not in done.stderr
    monkeypatch.setenv("PAIR_DPO_DEBUG", "1")
    with pytest.raises(ConfigError) as debug:
        train.run([*argv, "--use_cpu", "true"])
    assert debug.value.reason_code == "model_not_found" and "[model_not_found]" in str(debug.value)


@pytest.mark.slow  # one train.py run on the demo (~15 s), one refused in this process
def test_the_demo_with_no_eval_pairs_trains_and_saves_and_an_asked_evaluation_is_refused_before_training(
    tmp_path, capsys, monkeypatch
):
    done = _train_script(tmp_path, "--eval_size", "0", "--eval_strategy", "no", "--max_steps", "2", "--use_cpu", "true",
                         "--output_dir", str(tmp_path / "no_eval"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "no_eval" / "model.safetensors").is_file() and (tmp_path / "no_eval" / "checkpoint-2").is_dir()
    assert done.stdout.splitlines()[-3:] == [  # the run's last lines say where its outputs are
        f"  model        {tmp_path / 'no_eval'} (config.json, model.safetensors, the tokenizer)",
        f"  checkpoints  {tmp_path / 'no_eval' / 'checkpoint-2'}",
        f"  curves       {tmp_path / 'no_eval' / 'training_curves.png'}",
    ]
    state = json.loads((tmp_path / "no_eval" / "trainer_state.json").read_text())
    assert not any(key.startswith("eval_") for entry in state["log_history"] for key in entry)
    import train  # the refusal: train.py's run in this process, its exit code and stderr as a launch has them

    monkeypatch.delenv("PAIR_DPO_DEBUG", raising=False)
    capsys.readouterr()
    code = train.run(["--eval_size", "0", "--eval_on_start", "true", "--max_steps", "2", "--use_cpu", "true",
                      "--output_dir", str(tmp_path / "asked")])  # fmt: skip
    assert code == 1
    assert "train.py: error: [no_eval_dataset] eval_on_start=True evaluates during train()" in capsys.readouterr().err
    assert not (tmp_path / "asked" / "checkpoint-2").exists()


def test_the_cli_prints_a_reason_coded_error_as_one_message(capsys):
    from pair_dpo_trainer.cli import report_errors

    def fail() -> int:
        raise ConfigError("bad_args", "what to fix.")

    assert report_errors("pair-dpo x", fail) == 1
    assert (
        capsys.readouterr().err
        == "pair-dpo x: error: [bad_args] what to fix.\npair-dpo x: (the traceback: set PAIR_DPO_DEBUG=1)\n"
    )
    with pytest.raises(ConfigError):
        report_errors("pair-dpo x", fail, debug=True)
    assert "--debug" in cli_main.__globals__["build_parser"]().format_help()


def test_too_few_pairs_is_raised_from_the_row_count_before_the_model_loads_or_rows_tokenise(tmp_path, monkeypatch):
    from pair_dpo_trainer.training import loading

    def not_now(*_args, **_kwargs):
        raise AssertionError("loaded or tokenised before the schedule check")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", not_now)
    monkeypatch.setattr(loading, "pair_dataset_and_rendering", not_now)
    rows = generate_demo_pairs(seed=0, n=3)
    args = _config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    with pytest.raises(ScheduleError) as info:
        PairDPOTrainer(model=str(bundled_model_dir()), args=args, train_dataset=rows)
    assert info.value.reason_code == "too_few_pairs" and "has 3 rows" in info.value.message


# ------------------------------------------------------------------------------------------------ timeouts and disks


@pytest.mark.integration
@pytest.mark.parametrize("seconds", ["0", "-1"])
def test_train_script_refuses_a_timeout_that_lets_no_collective_wait_before_it_loads_the_model(
    tmp_path, capsys, seconds
):
    """``0`` in a real ``train.py`` process; ``-1`` (the same check) through ``train.run`` in this process."""
    typo = str(tmp_path / "no-model")  # reached only after the options: model_not_found would mean they passed
    argv = ["--model_name_or_path", typo, "--dataset", str(bundled_pairs_path()), "--output_dir", str(tmp_path)]
    if seconds == "0":
        done = _train_script(tmp_path, *argv, "--use_cpu", "true", "--ddp_timeout", seconds)
        code, stderr = done.returncode, done.stderr
    else:
        code, err = _train_in_process(tmp_path, capsys, "--use_cpu", "true", "--ddp_timeout", seconds)
        stderr = "\n".join(err)
    assert code == 1, stderr[-2000:]
    assert f"[bad_timeout] ddp_timeout={seconds} (--ddp_timeout)" in stderr and "1800" in stderr
    assert "model_not_found" not in stderr and "Loading weights" not in stderr


TMPFS_BYTES = 8 * 1024  # the train split of 300 demo rows (100 pairs) takes about 13 KiB tokenised


@pytest.mark.integration
@pytest.mark.skipif(not namespaces_available(), reason="needs root in a mount namespace (unshare) for a small tmpfs")
def test_a_full_disk_while_building_the_pairs_cache_is_named_and_leaves_no_partial_entry(tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(bundled_pairs_path().read_text().splitlines(keepends=True)[:300]))
    disk = tmp_path / "small-disk"
    disk.mkdir()
    cache = disk / "pairs"
    argv = [
        *("--model_name_or_path", str(bundled_model_dir()), "--dataset", str(rows)),
        *("--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--max_steps", "1"),
        *("--dataset_cache_dir", str(cache), "--report_to", "none"),
    ]
    # the tmpfs exists in the namespace only: what the run left in the cache is listed there, after it exits
    script = (
        f"mount -t tmpfs -o size={TMPFS_BYTES} small {shlex.quote(str(disk))} && "
        f"{shlex.join(_train_command(*argv))}; rc=$?; echo LEFT:; ls -A {shlex.quote(str(cache))}; exit $rc"
    )
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_script_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: [dataset_cache_unwritable]"), done.stderr[-3000:]
    assert str(cache) in lines[0] and "free of 8.0 KiB" in lines[0] and "dataset_cache_dir" in lines[0]
    assert done.stdout.split("LEFT:", 1)[1].split() == []  # no entry, no temporary directory
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------- train.py's launch checks


def _train_in_process(tmp_path: Path, capsys, *argv: str, output_dir: Path | None = None) -> tuple[int, list[str]]:
    """``train.py`` on a model path that does not exist (so ``model_not_found`` would mean the check under test let
    the run go on to loading): its exit code and its stderr lines."""
    import train

    real = ["--model_name_or_path", str(tmp_path / "no-model"), "--dataset", str(bundled_pairs_path())]
    code = train.run([*real, "--output_dir", str(output_dir or tmp_path / "out"), *argv])
    return code, capsys.readouterr().err.splitlines()


def test_a_logger_that_is_not_installed_is_one_line_before_anything_loads(tmp_path, capsys):
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    code, err = _train_in_process(tmp_path, capsys, "--use_cpu", "true", "--report_to", "tensorboard")
    assert code == 1 and len(err) == 2, err
    assert err[0].startswith("train.py: error: [report_to_unavailable] report_to 'tensorboard': its package is not")
    assert "pip install tensorboard" in err[0] and "--report_to none" in err[0]
    code, err = _train_in_process(tmp_path, capsys, "--use_cpu", "true", "--report_to", "tensorbord")
    assert code == 1 and err[0].endswith(
        "report_to 'tensorbord' is not a logging integration: did you mean 'tensorboard'?"
    )


def test_an_output_dir_that_cannot_be_written_is_one_line_before_anything_loads(tmp_path, capsys):
    """A path through a regular file (what root meets too); a read-only filesystem: the launch test below."""
    (tmp_path / "outputs").write_text("a file where the run's directory should be")
    code, err = _train_in_process(tmp_path, capsys, "--use_cpu", "true", output_dir=tmp_path / "outputs" / "run")
    assert code == 1 and len(err) == 2, err
    assert err[0] == (
        f"train.py: error: [output_dir_unwritable] output_dir {tmp_path / 'outputs' / 'run'}: {tmp_path / 'outputs'} "
        "is a file, not a directory. Choose another --output_dir."
    )


@pytest.mark.slow  # one train.py launch (~20 s on 2 shared cores)
@pytest.mark.skipif(
    not namespaces_available(), reason="needs root in a mount namespace (unshare) for a read-only mount"
)
def test_train_script_refuses_a_read_only_output_dir_before_it_loads_the_model(tmp_path):
    """The real fault: ``output_dir`` on a read-only filesystem (root cannot write it either)."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    argv = ["--model_name_or_path", str(bundled_model_dir()), "--dataset", str(bundled_pairs_path())]
    argv += ["--output_dir", str(readonly / "run"), "--use_cpu", "true", "--max_steps", "1"]
    script = f"mount -t tmpfs -o ro small {shlex.quote(str(readonly))} && {shlex.join(_train_command(*argv))}"
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_script_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("train.py:")]
    assert lines[0] == (
        f"train.py: error: [output_dir_unwritable] output_dir {readonly / 'run'} cannot be written ({readonly}: "
        "Read-only file system): the run saves its checkpoints and model there. Make it writable for this user, or "
        "choose another --output_dir."
    )
    assert len(lines) == 2 and "Traceback" not in done.stderr and "Loading weights" not in done.stderr


@pytest.mark.parametrize("asked", ["--bf16 True", "mixed_precision: bf16"])
def test_bf16_on_a_machine_without_gpus_runs_only_when_the_cpu_is_asked_for(tmp_path, capsys, monkeypatch, asked):
    """The flag and an accelerate config's bf16 get one answer: refused with the fix, or bf16 on the CPU with
    ``--use_cpu True``."""
    import train
    from pair_dpo_trainer.config import launch

    monkeypatch.setattr(launch, "accelerator_available", lambda: False)  # what this machine is; a GPU CI box too
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    flags = ["--bf16", "True"] if asked.startswith("--") else []
    if not flags:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    code, err = _train_in_process(tmp_path, capsys, *flags)
    assert code == 1 and len(err) == 2, err
    shown = asked if flags else "the accelerate config's mixed_precision: bf16"
    assert err[0].startswith(f"train.py: error: [no_gpu] this run asks for GPUs ({shown}) but torch sees none")
    assert "pass --use_cpu True" in err[0]
    _, _, config = train.parse_args(["--output_dir", str(tmp_path / "out"), *flags, "--use_cpu", "True"])
    assert config.bf16 is True and config.use_cpu is True and config.device.type == "cpu"


def test_the_end_of_a_run_names_where_the_model_checkpoints_and_curves_are(tmp_path):
    import train

    for step in (100, 20, 300):
        (tmp_path / f"checkpoint-{step}").mkdir()
    lines = train.where_written(str(tmp_path)).splitlines()
    assert lines == [
        "train.py: wrote",
        f"  model        {tmp_path} (config.json, model.safetensors, the tokenizer)",
        f"  checkpoints  {tmp_path}/checkpoint-100, {tmp_path}/checkpoint-300 (the last 2 of 3)",
        f"  curves       {tmp_path}/training_curves.png",
    ]
    assert train.where_written(str(tmp_path / "none")).splitlines()[2] == "  checkpoints  none (no save was due)"
