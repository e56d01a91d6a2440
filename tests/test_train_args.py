"""train.py arguments: demo settings only for the demo; a YAML/JSON file means exactly what the same flags mean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pair_dpo_trainer import ConfigError, PairDPOConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402

# A real run's options, as flags and as file values (YAML reads 5e-7 as the string "5e-7").
REAL = {
    "model_name_or_path": "/models/my-sft",
    "dataset": "/data/prepared",
    "learning_rate": "5e-7",
    "lr_scheduler_type": "cosine",
    "warmup_steps": 3,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "beta": 0.05,
    "max_length": 256,
    "bf16": False,
    "report_to": "none",
    "eval_strategy": "steps",
    "eval_steps": 7,
    "max_nonfinite_grad_skips": 3,
    "use_cpu": True,
}


def _flags(values: dict) -> list[str]:
    return [token for key, value in values.items() for token in (f"--{key}", str(value))]


def _parsed_three_ways(tmp_path: Path, values: dict) -> list[dict]:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(values))
    (tmp_path / "run.json").write_text(json.dumps(values))
    runs = [train.parse_args(_flags(values)), train.parse_args([str(tmp_path / "run.yaml")])]
    runs.append(train.parse_args([str(tmp_path / "run.json")]))
    return [{"model": m, "data": d, "args": c.to_dict()} for m, d, c in runs]


@pytest.mark.parametrize("kind", ["real", "demo"])
def test_yaml_json_and_flags_give_identical_training_arguments(tmp_path, kind):
    values = {**REAL, "output_dir": str(tmp_path / "out")}
    if kind == "demo":
        values = {"max_steps": 5, "use_cpu": True, "learning_rate": "2e-3"}
    flags, from_yaml, from_json = _parsed_three_ways(tmp_path, values)
    assert flags == from_yaml == from_json
    assert flags["args"]["learning_rate"] == (5e-7 if kind == "real" else 2e-3)
    assert flags["args"]["max_nonfinite_grad_skips"] == (3 if kind == "real" else 10)


def test_a_real_run_keeps_pair_dpo_config_defaults_not_the_demo_settings(tmp_path):
    model_args, data_args, config = train.parse_args(
        ["--model_name_or_path", "/models/my-sft", "--dataset", "/data/prepared", "--use_cpu", "true"]
    )
    defaults = PairDPOConfig(output_dir=str(tmp_path), use_cpu=True)
    for name in train.DEMO_DEFAULTS:
        if name != "output_dir":
            assert getattr(config, name) == getattr(defaults, name), name
    assert config.learning_rate == 1e-6 and config.max_length == 1024 and config.seed == 42
    assert config.output_dir != train.DEMO_DEFAULTS["output_dir"]
    assert (model_args.model_name_or_path, data_args.dataset) == ("/models/my-sft", "/data/prepared")


def test_the_demo_applies_its_settings_under_the_options_given():
    model_args, data_args, config = train.parse_args(["--max_steps", "3", "--seed", "7", "--use_cpu", "true"])
    assert model_args.model_name_or_path == str(train.bundled_model_dir())
    assert data_args.dataset == str(train.bundled_pairs_path())
    assert (config.max_steps, config.seed) == (3, 7)  # given options win
    for name in ("learning_rate", "max_length", "max_prompt_length", "num_train_epochs", "eval_steps"):
        assert getattr(config, name) == train.DEMO_DEFAULTS[name], name


@pytest.mark.parametrize("form", ["flags", "yaml"])
def test_the_demo_without_eval_pairs_drops_its_evaluation_defaults_but_keeps_an_asked_evaluation(tmp_path, form):
    def parsed(**values):
        if form == "flags":
            return train.parse_args(_flags({"use_cpu": True, **values}))[2]
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({"use_cpu": True, **values}))
        return train.parse_args([str(tmp_path / "run.yaml")])[2]

    config = parsed(eval_size=0)
    assert (str(config.eval_strategy.value), config.eval_on_start) == ("no", False)
    assert str(parsed(eval_size=10).eval_strategy.value) == train.DEMO_DEFAULTS["eval_strategy"]
    asked = parsed(eval_size=0, eval_strategy="steps")  # the trainer refuses it: no_eval_dataset
    assert str(asked.eval_strategy.value) == "steps" and "eval_strategy" in asked.options_given


@pytest.mark.parametrize("given", ["--model_name_or_path", "--dataset"])
def test_only_one_of_model_and_dataset_is_an_error(given):
    with pytest.raises(ConfigError) as info:
        train.parse_args([given, "/somewhere", "--use_cpu", "true"])
    assert info.value.reason_code == "incomplete_arguments"
    assert "--model_name_or_path" in str(info.value) and "--dataset" in str(info.value)


def test_trl_flags_and_yaml_keys_raise_unsupported_option_naming_the_equivalent(tmp_path):
    with pytest.raises(ConfigError) as flag:
        train.parse_args(["--rpo-alpha", "0.5", "--use_cpu", "true"])
    assert flag.value.reason_code == "unsupported_option" and "nll_weight" in str(flag.value)
    (tmp_path / "trl.yaml").write_text("padding_free: true\nprecompute_ref_logps: true\n")
    with pytest.raises(ConfigError) as key:
        train.parse_args([str(tmp_path / "trl.yaml")])
    assert [text.split(":")[0] for _, text in key.value.problems] == ["padding_free", "precompute_ref_logps"]


@pytest.mark.integration
def test_help_lists_the_dpo_options_first_without_importing_the_trainer_or_peft(tmp_path):
    """``train.py --help`` builds the parser only: no trainer, no transformers ``Trainer``, no ``peft`` (which
    transformers' ``TrainingArguments`` would import) are imported, and the pair DPO options come first."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['train.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = [m for m in ('peft', 'transformers.trainer', 'pair_dpo_trainer.trainer') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "pair DPO options (the TrainingArguments options follow):"
    assert lines[1].split()[0] == "--model_name_or_path" and any(line.split()[:1] == ["--beta"] for line in lines[:10])
    assert "HEAVY []" in lines
    assert any(line.lstrip().startswith("--learning_rate") for line in lines)  # every option still follows


# ------------------------------------------------------------------ mistyped options and unreadable files


@pytest.mark.parametrize("flag", ["--learning_rat", "--learnin_rate"])
def test_a_mistyped_flag_is_refused_naming_the_option_meant(flag):
    """argparse's prefix matching is off: ``--learning_rat`` would otherwise set ``learning_rate`` silently."""
    with pytest.raises(ConfigError) as info:
        train.parse_args([flag, "1e-3", "--use_cpu", "true"])
    assert info.value.reason_code == "unknown_option"
    assert info.value.message == f"{flag} is not an option: did you mean --learning_rate?"


def test_a_mistyped_file_key_and_several_unknown_flags_are_each_named(tmp_path):
    (tmp_path / "run.yaml").write_text("learning_rat: 1.0e-3\nuse_cpu: true\n")
    with pytest.raises(ConfigError) as key:
        train.parse_args([str(tmp_path / "run.yaml")])
    assert key.value.reason_code == "unknown_option"
    assert key.value.message == f"{tmp_path / 'run.yaml'}: learning_rat is not an option: did you mean learning_rate?"
    with pytest.raises(ConfigError) as flags:
        train.parse_args(["--bta", "0.2", "--zzzz", "1", "--use_cpu", "true"])
    assert [text for _, text in flags.value.problems] == [
        "--bta is not an option: did you mean --beta?",
        "--zzzz is not an option: train.py --help lists every option.",
    ]


def test_a_yaml_tag_is_refused_with_its_line_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "run.yaml"
    path.write_text(f"use_cpu: true\noutput_dir: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError) as info:
        train.parse_args([str(path)])
    assert info.value.reason_code == "bad_config_file"
    assert info.value.message.startswith(f"{path}: line 2: the YAML tag !!python/object/apply:os.system is not read")
    assert not marker.exists()
    (tmp_path / "broken.json").write_text('{"beta": 0.1,\n "max_length": }\n')
    with pytest.raises(ConfigError) as broken:
        train.parse_args([str(tmp_path / "broken.json")])
    assert broken.value.reason_code == "bad_config_file" and "line 2: not valid JSON" in broken.value.message


@pytest.mark.parametrize(
    "argv,code",
    [
        (["--learning_rat", "1e-3"], "unknown_option"),
        (["RUN_YAML"], "bad_config_file"),
    ],
)
def test_the_script_prints_a_mistyped_option_or_a_bad_file_as_one_line_and_exits_1(tmp_path, capsys, argv, code):
    (tmp_path / "run.yaml").write_text("beta: !!python/name:os.system\n")
    argv = [str(tmp_path / "run.yaml") if token == "RUN_YAML" else token for token in argv]
    assert train.run(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"train.py: error: [{code}] ") and err[1:] == [
        "train.py: (the traceback: set PAIR_DPO_DEBUG=1)"
    ]


def _small_file(tmp_path: Path, n: int) -> Path:
    from pair_dpo_trainer.demo import bundled_pairs_path

    path = tmp_path / "small.jsonl"
    path.write_text("".join(bundled_pairs_path().read_text(encoding="utf-8").splitlines(True)[:n]), encoding="utf-8")
    return path


def test_too_few_pairs_after_the_eval_split_names_the_split_and_eval_size(tmp_path, capsys):
    from pair_dpo_trainer.demo import bundled_model_dir
    from pair_dpo_trainer.errors import ScheduleError

    argv = ["--model_name_or_path", str(bundled_model_dir()), "--dataset", str(_small_file(tmp_path, 150))]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--report_to", "none", "--eval_size", "146"]
    with pytest.raises(ScheduleError) as info:  # raised before the model or the tokenizer loads
        train.main(argv)
    assert info.value.reason_code == "too_few_pairs"
    message = info.value.message
    assert message.startswith("the dataset has 4 rows for training (146 held out for evaluation by --eval_size 146)")
    assert "lower --eval_size (0: none)" in message and "per_device_train_batch_size" in message
    assert (
        "train.py: " + str(tmp_path / "small.jsonl") + ": 150 rows: 4 for training, 146 held out"
        in capsys.readouterr().out
    )


def test_eval_size_takes_a_count_or_auto_and_the_demo_keeps_its_200(tmp_path):
    _, data, _ = train.parse_args(["--output_dir", str(tmp_path), "--use_cpu", "true"])
    assert data.eval_size == 200
    _, data, _ = train.parse_args(["--model_name_or_path", "m", "--dataset", "d.jsonl", "--output_dir", str(tmp_path)])
    assert data.eval_size == "auto"
    with pytest.raises(ConfigError) as info:
        train.parse_args(["--model_name_or_path", "m", "--dataset", "d.jsonl", "--eval_size", "5%"])
    assert info.value.reason_code == "bad_args" and "--eval_size='5%'" in info.value.message


def test_too_few_pairs_from_a_prepared_directory_names_its_rejections_and_eval_split(tmp_path):
    from pair_dpo_trainer.cli import main as cli_main
    from pair_dpo_trainer.demo import bundled_model_dir
    from pair_dpo_trainer.errors import ScheduleError

    source = _small_file(tmp_path, 12)
    source.write_text(source.read_text(encoding="utf-8") + "{not json\n" + '{"prompt": "p"}\n', encoding="utf-8")
    prepared = tmp_path / "prepared"
    argv = ["prepare-data", str(source), "--output", str(prepared), "--tokenizer", str(bundled_model_dir())]
    assert cli_main([*argv, "--eval-size", "4", "--disable-tqdm"]) == 0
    run = ["--model_name_or_path", str(bundled_model_dir()), "--dataset", str(prepared), "--use_cpu", "true"]
    with pytest.raises(ScheduleError) as info:  # 8 train pairs left; the step needs 16
        train.main([*run, "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "16"])
    message = info.value.message
    assert message.startswith(
        "the dataset has 8 rows for training (2 rejected by prepare-data (bad_json: 1, schema: 1); 4 held out for "
        "evaluation by prepare-data --eval-size 4)"
    )
    assert "lower prepare-data --eval-size (0: none)" in message and "fix the rejected rows" in message
