"""Train pair DPO: ``python train.py [flags | config.yaml | config.json]``; several GPUs: ``accelerate launch ...``.

A real run names both ``--model_name_or_path`` and ``--dataset``; every other option keeps ``PairDPOConfig``'s
default unless given. With neither, it trains the bundled tiny Llama on the bundled demo preference pairs (no
downloads) with the demo settings (``DEMO_DEFAULTS``) and writes checkpoints, ``trainer_state.json`` and
``training_curves.png`` into ``outputs/pair-dpo-demo``. A YAML/JSON file and the same flags give the same arguments.
A reason-coded error is printed as one message (``PAIR_DPO_DEBUG=1`` adds the traceback); ``--help`` lists the DPO
options first. Heavy modules (the trainer, transformers' ``Trainer``) are imported only when a run starts.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pair_dpo_trainer.cli import report_errors
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.errors import ConfigError

# The bundled demo run: these apply only when neither --model_name_or_path nor --dataset is given (any option given
# overrides them). A real run gets PairDPOConfig's own defaults (docs/guide.md, "Defaults that differ from
# TrainingArguments").
DEMO_DEFAULTS = {
    "output_dir": "outputs/pair-dpo-demo",
    "learning_rate": 1e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "num_train_epochs": 2.0,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "beta": 0.1,
    "max_length": 128,
    "max_prompt_length": 64,
    "eval_strategy": "steps",
    "eval_on_start": True,
    "eval_steps": 50,
    "logging_steps": 10,
    "save_steps": 100,
    "save_total_limit": 2,
    "report_to": "none",
    "seed": 0,
}
DEMO_EVAL_SIZE = 200
"""Pairs the demo holds out of its 2,400 with ``--eval_size auto`` (a user's file: ``splits.resolve_eval_size``)."""
NO_EVAL_DEMO_DEFAULTS = {**DEMO_DEFAULTS, "eval_strategy": "no", "eval_on_start": False}
"""The demo's defaults with ``--eval_size 0``: no eval pairs, so the demo's evaluation defaults fall away with them (an
evaluation asked for explicitly is refused: ``no_eval_dataset``)."""
LIST_FLAGS = ("--loss_type", "--loss_weights")
"""Flags whose value may also be written comma-separated (``--loss_weights 0.8,0.2,1``): split into separate values
before the argument parser converts each one."""


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Local directory of the policy (and, by default, of the reference). Leave it and --dataset unset "
            "for the bundled demo run (bundled tiny Llama and pairs, demo settings)."
        },
    )


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A jsonl/json/parquet file of preference rows, or a `pair-dpo prepare-data` output dir. Leave it "
            "and --model_name_or_path unset for the bundled demo run."
        },
    )
    eval_size: str = field(
        default="auto",
        metadata={
            "help": "Pairs held out for evaluation when `dataset` is a single file: a number (0: none), or auto: "
            "5 percent of the pairs, at most 200, none when that is under 16 (the demo holds out 200). The run prints "
            "what was held out."
        },
    )


def argument_classes() -> tuple[type, ...]:
    """``(ModelArguments, DataArguments, PairDPOConfig)``: the dataclasses of train.py's options."""
    from pair_dpo_trainer.config import PairDPOConfig

    return (ModelArguments, DataArguments, PairDPOConfig)


def __getattr__(name: str) -> Any:
    if name == "ARGUMENT_CLASSES":  # imported on first use: the config imports transformers' TrainingArguments
        return argument_classes()
    raise AttributeError(f"module 'train' has no attribute {name!r}")


def parse_args(argv: list[str]) -> tuple[Any, Any, Any]:
    """Flags, or a single YAML/JSON file of the same names; the same values give the same arguments either way.

    With neither a model nor a dataset this is the bundled demo: ``DEMO_DEFAULTS`` under the options given, the
    bundled model and pairs. Otherwise both are required and only the given options change ``PairDPOConfig``'s
    defaults. TRL option names (and our old ones) raise ``unsupported_option`` naming the equivalent. The config
    records which options were given (``PairDPOConfig.options_given``).
    """
    from transformers import HfArgumentParser

    from pair_dpo_trainer.config.trl_names import (
        config_field_names,
        reject_unsupported_options,
        unknown_option_problems,
    )

    classes = argument_classes()
    parser = HfArgumentParser(classes, allow_abbrev=False)  # --learning_rat is unknown, not --learning_rate
    file_values = _config_file_values(argv)
    argv = _split_list_flags(argv) if file_values is None else argv
    given = _flag_names(argv) if file_values is None else list(file_values)
    known = set().union(*(config_field_names(cls) for cls in classes))
    reject_unsupported_options(given, where="train.py", known=known)
    if file_values is not None:
        _raise_unknown(unknown_option_problems(file_values, known=known, prefix=""), where=argv[0])
        demo = _is_demo(file_values.get("model_name_or_path"), file_values.get("dataset"))
        defaults = _demo_defaults(file_values.get("eval_size"))
        values = {**defaults, **file_values} if demo else file_values
        parsed = _with_demo_paths(parser.parse_dict(_as_flag_types(parser, values)), demo)
    else:
        namespace, leftover = parser.parse_known_args(argv)
        _raise_unknown(_unknown_flag_problems(parser, leftover))
        demo = _is_demo(namespace.model_name_or_path, namespace.dataset)
        defaults = _demo_defaults(namespace.eval_size)
        if demo:
            parser.set_defaults(**defaults)
        parsed = _with_demo_paths(parser.parse_args_into_dataclasses(argv), demo)
    parsed[2].mark_options_given([*given, *(defaults if demo else ())])
    return parsed


def _unknown_flag_problems(parser: Any, leftover: list[str]) -> list[tuple[str, str]]:
    """``unknown_option`` for each flag the parser did not take (a stray word when there is no flag among them)."""
    from pair_dpo_trainer.config.trl_names import unknown_option_problems

    options = {name[2:] for action in parser._actions for name in action.option_strings if name.startswith("--")}
    flags = [token[2:].split("=", 1)[0] for token in leftover if token.startswith("--")]
    problems = unknown_option_problems(flags, known={name for name in options if "-" not in name})
    if leftover and not problems:
        fix = "train.py takes --name value flags, or one YAML/JSON file given alone."
        problems = [("unknown_option", f"unexpected argument {leftover[0]!r}: {fix}")]
    return problems


def _raise_unknown(problems: list[tuple[str, str]], *, where: str | None = None) -> None:
    """One ``ConfigError`` (``unknown_option``) for the options of ``problems`` (nothing when there is none).

    Args:
        problems: ``unknown_option`` problems.
        where: The config file that named them (None: the command line).
    """
    if len(problems) == 1:
        text = problems[0][1]
        raise ConfigError("unknown_option", text if where is None else f"{where}: {text}", problems=problems)
    if problems:
        lines = "\n".join(f"  - {text}" for _, text in problems)
        message = f"{where or 'the command line'} has {len(problems)} unknown options:\n{lines}"
        raise ConfigError("unknown_option", message, problems=problems)


def _demo_defaults(eval_size: Any) -> dict[str, Any]:
    """:data:`DEMO_DEFAULTS`, or :data:`NO_EVAL_DEMO_DEFAULTS` when ``--eval_size`` is 0."""
    from pair_dpo_trainer.data.splits import parse_eval_size

    return NO_EVAL_DEMO_DEFAULTS if eval_size is not None and parse_eval_size(eval_size) == 0 else DEMO_DEFAULTS


def _split_list_flags(argv: list[str]) -> list[str]:
    """``--loss_weights 0.8,0.2,1`` as ``--loss_weights 0.8 0.2 1`` (and ``--loss_type`` likewise)."""
    out: list[str] = []
    in_list = False
    for token in argv:
        name, equals, value = token.partition("=")
        if token.startswith("--"):
            in_list = name in LIST_FLAGS
            out.extend([name, *value.split(",")] if in_list and equals else [token])
        elif in_list and "," in token:
            out.extend(part for part in token.split(",") if part)
        else:
            out.append(token)
    return out


def _config_file_values(argv: list[str]) -> dict[str, Any] | None:
    """The mapping of a lone ``.yaml`` / ``.yml`` / ``.json`` argument, else None."""
    if len(argv) != 1 or not argv[0].endswith((".yaml", ".yml", ".json")):
        return None
    path = argv[0]
    try:
        text = Path(path).read_text(encoding="utf-8")
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as error:  # JSONDecodeError is a ValueError
        raise ConfigError("bad_config_file", f"{path}: {_file_problem(error)}") from error
    if not isinstance(values, dict):
        raise ConfigError("bad_args", f"{argv[0]}: expected a mapping of option names to values.")
    return values


def _file_problem(error: Exception) -> str:
    """What is wrong with a config file that cannot be read, and how to fix it."""
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    if isinstance(error, yaml.constructor.ConstructorError):  # safe_load builds no object of a tag: no code runs
        quoted = str(error.problem).split("'")
        tag = quoted[1].replace("tag:yaml.org,2002:", "!!") if len(quoted) > 2 else "a tag"
        return (
            f"{where}the YAML tag {tag} is not read: a config file holds plain names and values (strings, numbers, "
            "true/false, lists), nothing that builds Python objects. Remove the tag."
        )
    if isinstance(error, yaml.YAMLError):
        return f"{where}not valid YAML ({getattr(error, 'problem', None) or error}). Fix the file."
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}: not valid JSON ({error.msg}). Fix the file."
    if isinstance(error, OSError):
        return f"cannot read it ({error.strerror or error}). Check the path."
    return f"cannot read it ({error}). Save it as UTF-8 text."


def _flag_names(argv: list[str]) -> list[str]:
    return [token[2:].split("=", 1)[0] for token in argv if token.startswith("--")]


def _as_flag_types(parser: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Converts string values of a file as the same flag would be (YAML reads ``1e-6`` as a string, for one)."""
    types = {action.dest: action.type for action in parser._actions if callable(action.type)}
    return {
        key: types[key](value) if isinstance(value, str) and types.get(key) not in (None, str) else value
        for key, value in values.items()
    }


def _is_demo(model_name_or_path: str | None, dataset: str | None) -> bool:
    if (model_name_or_path is None) != (dataset is None):
        missing = "--dataset" if dataset is None else "--model_name_or_path"
        raise ConfigError(
            "incomplete_arguments",
            f"train.py: {missing} is not set. Give both --model_name_or_path and --dataset for a real run, or "
            "neither for the bundled demo.",
        )
    return model_name_or_path is None


def _with_demo_paths(parsed: tuple, demo: bool) -> tuple[Any, Any, Any]:
    from pair_dpo_trainer.data.splits import AUTO_EVAL, parse_eval_size

    model_args, data_args, config = parsed
    data_args.eval_size = parse_eval_size(data_args.eval_size)
    if demo:
        model_args.model_name_or_path = str(bundled_model_dir())
        data_args.dataset = str(bundled_pairs_path())
        data_args.eval_size = DEMO_EVAL_SIZE if data_args.eval_size == AUTO_EVAL else data_args.eval_size
    return model_args, data_args, config


def _is_bundled(path: str) -> bool:
    return Path(path).resolve() == bundled_model_dir().resolve()


def _first_sentence(text: str, width: int = 82) -> str:
    """The help text up to its first full stop (not the one of "e.g."), cut to ``width`` characters."""
    import re

    sentence = re.split(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z(])", text, maxsplit=1)[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def print_help() -> None:
    """``train.py --help``: the DPO options first (one line each), then every option. Built without importing
    ``peft``, which transformers' ``TrainingArguments`` would import for nothing here."""
    import dataclasses

    import transformers.utils

    transformers.utils.is_peft_available = lambda: False  # --help only: the process exits after printing
    from transformers import HfArgumentParser, TrainingArguments

    classes = argument_classes()
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    lines = ["pair DPO options (the TrainingArguments options follow):"]
    for cls in classes:
        for option in dataclasses.fields(cls):
            if option.name in inherited and cls is not ModelArguments and cls is not DataArguments:
                continue
            lines.append(f"  --{option.name:<32} {_first_sentence(str(option.metadata.get('help', '')))}")
    print("\n".join(lines) + "\n")
    HfArgumentParser(classes).print_help()


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parses the arguments and runs: a stop signal (SIGTERM, SIGINT) at any point exits with 75, also while the
    arguments are parsed (the handler is installed first).

    In the training loop the run finishes the optimizer step and saves a checkpoint first; the final save is finished
    before stopping; anywhere else it stops at once, removing its temporary files (``fault_tolerance.preemption``).
    Either way ``--resume_from_checkpoint auto`` (or ``latest`` once a checkpoint exists) goes on from there.
    """
    from pair_dpo_trainer.fault_tolerance.preemption import stop_on_signal

    output_dir: list[str] = []  # known once the options are parsed: where a stop signal's marker goes
    with stop_on_signal(
        "train.py (reading the options, reading the data)", output_dir=lambda: next(iter(output_dir), None)
    ):
        from pair_dpo_trainer.fault_tolerance.launcher import follow_launcher

        model_args, data_args, config = parse_args(sys.argv[1:] if argv is None else argv)
        output_dir.append(config.output_dir)
        follow_launcher()
        return _run(model_args, data_args, config)


def _run(model_args: ModelArguments, data_args: DataArguments, config: Any) -> dict[str, float]:
    from pair_dpo_trainer.cli.plot import CURVES_FILENAME, plot_training_curves
    from pair_dpo_trainer.data.splits import load_train_eval
    from pair_dpo_trainer.fault_tolerance.preemption import stop_on_signal
    from pair_dpo_trainer.modeling.paths import require_model_directory
    from pair_dpo_trainer.samplers.planner import check_enough_pairs
    from pair_dpo_trainer.trainer import PairDPOTrainer
    from pair_dpo_trainer.training.checks import check_config
    from pair_dpo_trainer.training.options import reference_options

    check_config(config)  # every option problem now, before the model, tokenizer or data load
    uses = reference_options(config).uses_reference  # the run's one decision of whether it has a reference
    if _is_bundled(model_args.model_name_or_path) and uses and config.ref_model_revision is None:
        config.ref_model_revision = DEMO_REVISION  # the bundled snapshot ships pinned at this revision
    require_model_directory(
        model_args.model_name_or_path, role="policy", option="--model_name_or_path", code="model_not_found"
    )
    split = load_train_eval(data_args.dataset, eval_size=data_args.eval_size, seed=config.seed)
    train_rows, eval_rows = split.train, split.eval
    if config.process_index == 0:
        print(f"train.py: {split.describe()}", flush=True)
    check_enough_pairs(
        len(train_rows),
        world_size=config.world_size,
        pairs_per_rank=config.pairs_per_rank_per_step,
        rows="rows for training",
        spent=split.spent(),
    )
    trainer = PairDPOTrainer(  # loads the tokenizer itself, once the snapshot is verified (no remote code runs)
        model=model_args.model_name_or_path,
        args=config,
        train_dataset=train_rows,
        eval_dataset=eval_rows or None,
    )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    metrics = trainer.evaluate() if eval_rows else {}
    with stop_on_signal("the final save", defer=True):  # finished, then stopped: never a half-written final model
        trainer.save_model()
        trainer.save_state()
        if trainer.is_world_process_zero():
            plot_training_curves(trainer.state.log_history, f"{config.output_dir}/{CURVES_FILENAME}")
            if metrics:  # a run without an eval split has no final metrics to print
                print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
            print(where_written(config.output_dir), flush=True)
    return metrics


def where_written(output_dir: str) -> str:
    """The run's last lines: where the model, the checkpoints and the curves PNG are (absolute paths)."""
    from pair_dpo_trainer.cli.plot import CURVES_FILENAME

    out = Path(output_dir).absolute()
    steps = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit())
    checkpoints = ", ".join(str(out / f"checkpoint-{step}") for step in steps[-2:]) or "none (no save was due)"
    if len(steps) > 2:
        checkpoints += f" (the last 2 of {len(steps)})"
    return (
        f"train.py: wrote\n  model        {out} (config.json, model.safetensors, the tokenizer)\n"
        f"  checkpoints  {checkpoints}\n  curves       {out / CURVES_FILENAME}"
    )


def run(argv: list[str]) -> int:
    """The script: ``--help``, or a run whose reason-coded error is printed as one message (exit code 1)."""
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0

    def train_and_end() -> int:
        from pair_dpo_trainer.parallel.collectives import end_process_group

        main(argv)
        end_process_group()  # every rank together; a gloo group alive at interpreter exit can abort the process
        return 0

    return report_errors("train.py", train_and_end)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
