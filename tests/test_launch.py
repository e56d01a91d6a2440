"""Every documented launch path starts what it says: shipped accelerate configs, torchrun, --deepspeed, the deepspeed
launcher.

The 2-process launches run train.py itself on the CPU (gloo, fp32) for 2 optimizer steps on 64 demo pairs, and check
that the processes formed ONE job (``world_size=2`` in the run summary, printed once, by rank 0) that trained. They
are few on purpose (each costs 15-60 s on 2 cores): the accelerate ``cpu_2proc.yaml`` launch is also the
"torchrun without --use_cpu" case (accelerate runs torchrun, and only the hidden GPUs, ``CUDA_VISIBLE_DEVICES=``,
tell the processes to use the CPU), the
``torchrun --deepspeed`` launch loads the policy by path under ``zero.Init``, and the ``deepspeed`` launcher runs
without
``--use_cpu``. Configs that need GPUs are checked by accelerate's own launch-argument parsing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pair_dpo_trainer.config import launch
from pair_dpo_trainer.demo import bundled_model_dir, bundled_pairs_path
from tests.ports import free_port
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
DS_ZERO3 = CONFIGS / "deepspeed" / "zero3.json"


# ------------------------------------------------------------------ the pure launch rules


def test_launcher_world_size_reads_torchrun_and_mpi_variables():
    assert launch.launcher_world_size({}) == 1
    assert launch.launcher_world_size({"WORLD_SIZE": "4"}) == 4
    assert launch.launcher_world_size({"OMPI_COMM_WORLD_SIZE": "2"}) == 2
    assert launch.launcher_world_size({"WORLD_SIZE": ""}) == 1


@pytest.mark.parametrize(
    "use_cpu,env,accelerator,expected",
    [
        (False, {"WORLD_SIZE": "2"}, False, True),  # torchrun on a CPU-only machine: one gloo job
        (False, {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, False, True),
        (False, {"WORLD_SIZE": "2"}, True, False),  # GPUs: accelerate uses them
        (False, {}, False, False),  # one process: TrainingArguments picks the device itself
        (True, {}, True, True),  # the user's choice stays
    ],
)
def test_a_multi_process_launch_without_accelerator_runs_on_the_cpu(monkeypatch, use_cpu, env, accelerator, expected):
    monkeypatch.setattr(launch, "accelerator_available", lambda: accelerator)
    assert launch.resolve_use_cpu(use_cpu, env=env) is expected


@pytest.mark.parametrize(
    "bf16,use_cpu,env,refused",
    [
        (None, False, {"WORLD_SIZE": "8", "ACCELERATE_MIXED_PRECISION": "bf16"}, True),  # multi_gpu_ddp.yaml
        (True, False, {}, True),  # --bf16 True
        (None, False, {"ACCELERATE_MIXED_PRECISION": "bf16"}, True),  # single_gpu.yaml
        (None, True, {"WORLD_SIZE": "8", "ACCELERATE_MIXED_PRECISION": "bf16"}, False),  # --use_cpu True: asked
        (True, False, {"CUDA_VISIBLE_DEVICES": ""}, False),  # every GPU hidden: the CPU is the choice
        (None, False, {}, False),  # one float32 process: a CPU run asks for no GPU
        (False, False, {"CUDA_VISIBLE_DEVICES": "0"}, False),
    ],
)
def test_a_run_that_asks_for_gpus_on_a_machine_without_them_needs_use_cpu(monkeypatch, bf16, use_cpu, env, refused):
    monkeypatch.setattr(launch, "accelerator_available", lambda: False)
    problem = launch.no_gpu_problem(bf16, use_cpu=use_cpu, env=env)
    assert (problem is not None) is refused
    if refused:
        assert "pass --use_cpu True" in problem
    else:  # what then runs: on the CPU, one job, the bf16 asked for (TrainingArguments takes it with use_cpu)
        asked = bool(launch.gpu_requests(bf16, env=env))
        assert launch.resolve_use_cpu(use_cpu, env=env, bf16=bf16) is (use_cpu or asked)
    monkeypatch.setattr(launch, "accelerator_available", lambda: True)
    assert launch.no_gpu_problem(bf16, use_cpu=use_cpu, env=env) is None


def test_processes_that_do_not_form_one_job_are_named():
    assert launch.launch_problem(2, {"WORLD_SIZE": "2"}) is None
    assert launch.launch_problem(1, {}) is None
    assert "did not join one job" in launch.launch_problem(1, {"WORLD_SIZE": "2"})
    # accelerate's MULTI_CPU launcher: MASTER_PORT set for num_processes > 1, then ONE process without WORLD_SIZE.
    one_of_many = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert "ONE process" in launch.launch_problem(1, one_of_many)
    assert launch.launch_problem(2, {**one_of_many, "OMPI_COMM_WORLD_SIZE": "2"}) is None  # under mpirun


@pytest.mark.parametrize(
    "env,refused",
    [
        ({}, False),  # not under torchrun
        ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # no restarts
        ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),  # static, or c10d default
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # c10d, store of its own
    ],
)
def test_a_restartable_elastic_launch_needs_a_store_of_its_own(env, refused):
    """The variables torchrun 2.13 sets for ``--max-restarts N`` (TORCHELASTIC_USE_AGENT_STORE=False with c10d and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a restart through the shared store never connects (tests/test_multinode
    restarts with it off)."""
    problem = launch.elastic_restart_problem(env)
    assert (problem is not None) is refused
    if refused:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem and "--rdzv-backend c10d" in problem


def test_the_config_refuses_a_restartable_launch_on_the_shared_store(monkeypatch, tmp_path):
    from pair_dpo_trainer import ConfigError, PairDPOConfig

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError) as refused:
        PairDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert refused.value.reason_code == "elastic_restart_unsafe"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    PairDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")


# ------------------------------------------------------------------ shipped accelerate configs, parsed by accelerate

# config -> (launcher accelerate picks, processes, what else the name promises)
EXPECTED_CONFIGS = {
    "cpu_2proc.yaml": ("torchrun", 2, {"use_cpu": True, "mixed_precision": "no"}),
    "single_gpu.yaml": ("single process", 1, {"mixed_precision": "bf16", "use_cpu": False}),
    "multi_gpu_ddp.yaml": ("torchrun", 8, {"mixed_precision": "bf16", "use_cpu": False}),
    "zero3.yaml": ("deepspeed", 8, {"zero_stage": 3, "offload_param_device": "none", "mixed_precision": "bf16"}),
    "zero3_offload.yaml": ("deepspeed", 8, {"zero_stage": 3, "offload_param_device": "cpu"}),
    "zero3_overlap.yaml": ("deepspeed", 8, {"zero_stage": 3}),
    "zero3_sequence_parallel.yaml": ("deepspeed", 8, {"zero_stage": 3, "mixed_precision": "bf16"}),
    "zero3_multinode.yaml": ("deepspeed", 64, {"zero_stage": 3, "num_machines": 8}),
    "fsdp2.yaml": ("fsdp (torchrun)", 8, {"fsdp_version": 2, "fsdp_offload_params": False, "mixed_precision": "bf16"}),
    "fsdp2_offload.yaml": ("fsdp (torchrun)", 8, {"fsdp_version": 2, "fsdp_offload_params": True}),
    "fsdp2_multinode.yaml": ("fsdp (torchrun)", 64, {"fsdp_version": 2, "num_machines": 8}),
}


def _accelerate_decision(config: Path) -> tuple[str, int, dict]:
    """What ``accelerate launch --config_file config train.py`` would start (its own parsing, nothing launched)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args, defaults, _ = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(config), "x"])
    )
    launcher = "deepspeed" if args.use_deepspeed else "fsdp (torchrun)" if args.use_fsdp else None
    launcher = launcher or ("torchrun" if args.multi_gpu else "single process")
    ds = {**(defaults.deepspeed_config or {}), **(defaults.fsdp_config or {})}
    if "deepspeed_config_file" in ds:
        ds_file = json.loads((ROOT / ds["deepspeed_config_file"]).read_text())
        ds["zero_stage"] = ds_file["zero_optimization"]["stage"]
    facts = {"use_cpu": bool(args.use_cpu), "mixed_precision": args.mixed_precision, "num_machines": args.num_machines}
    return launcher, int(args.num_processes), {**facts, **ds}


def test_the_multinode_configs_state_the_rendezvous_accelerate_uses():
    """accelerate 1.15 takes ``rdzv_backend`` and ``same_network`` from the command line only (their flags have
    defaults, and a config value is used only where a flag is unset): a config saying ``c10d`` ran a static
    rendezvous. The shipped multi-node configs say what runs; c10d is asked for on the command line (guide
    section 9)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    for name in ("zero3_multinode.yaml", "fsdp2_multinode.yaml"):
        stated = yaml.safe_load((CONFIGS / name).read_text())
        args, _, _ = _validate_launch_command(
            launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "x"])
        )
        assert (stated["rdzv_backend"], stated["same_network"]) == (args.rdzv_backend, args.same_network), name


def test_every_shipped_config_is_checked():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_shipped_accelerate_config_starts_what_its_name_says(name):
    launcher, processes, facts = _accelerate_decision(CONFIGS / name)
    expected_launcher, expected_processes, expected_facts = EXPECTED_CONFIGS[name]
    assert (launcher, processes) == (expected_launcher, expected_processes)
    assert {key: facts.get(key) for key in expected_facts} == expected_facts


def test_the_deepspeed_json_for_the_trainer_flag_is_zero3_with_auto_sizes():
    config = json.loads(DS_ZERO3.read_text())
    assert config["zero_optimization"]["stage"] == 3
    assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] == "auto"


# ------------------------------------------------------------------ real 2-process launches of train.py


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launch_data") / "pairs.jsonl"
    path.write_text("".join(bundled_pairs_path().read_text().splitlines(keepends=True)[:64]))
    return path


def _train_args(out: Path, pairs: Path) -> list[str]:
    return [
        "--model_name_or_path", str(bundled_model_dir()), "--dataset", str(pairs), "--eval_size", "0",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--max_length", "128", "--logging_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true",
        "--output_dir", str(out),
    ]  # fmt: skip


def _launch_env() -> dict[str, str]:
    """The environment of the test launches: CPU only (every GPU hidden), one thread per process, this checkout."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "pair_dpo_torch_extensions")
        ),
    }


def _launch(prefix: list[str], tmp_path: Path, pairs: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "out"
    command = [*prefix, str(ROOT / "train.py"), *_train_args(out, pairs), *extra]
    done = subprocess.run(command, env=_launch_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output, json.loads((out / "trainer_state.json").read_text())


def _assert_one_two_process_job(output: str, state: dict) -> None:
    summaries = [line for line in output.splitlines() if line.startswith("pair_dpo: world_size=")]
    assert len(summaries) == 1 and summaries[0].startswith("pair_dpo: world_size=2 | 8 pairs/step"), summaries
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert state["global_step"] == 2 and len(losses) == 2
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)


@pytest.mark.distributed
@pytest.mark.slow
def test_accelerate_launch_with_cpu_2proc_config_runs_one_two_process_job(tmp_path, pairs_file):
    config = yaml.safe_load((CONFIGS / "cpu_2proc.yaml").read_text())
    assert "--use_cpu" not in _train_args(tmp_path, pairs_file)  # the processes are not told to use the CPU
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml")]
    prefix += ["--main_process_port", str(free_port())]
    output, state = _launch(prefix, tmp_path, pairs_file)
    _assert_one_two_process_job(output, state)
    assert config["num_processes"] == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_with_the_trainer_deepspeed_flag_runs_zero3(tmp_path, pairs_file):
    """``torchrun train.py --deepspeed``: the policy is loaded by path under ``deepspeed.zero.Init`` before the Trainer
    exists."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    output, state = _launch(prefix, tmp_path, pairs_file, "--use_cpu", "True", "--deepspeed", str(DS_ZERO3))
    _assert_one_two_process_job(output, state)
    assert "ZeRO-3 leaf modules LlamaDecoderLayer" in output  # printed only under ZeRO-3


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_launcher_runs_zero3(tmp_path, pairs_file):
    prefix = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    # the launcher names GPUs (CUDA_VISIBLE_DEVICES=0,1): on this CPU machine the user chooses the CPU (no_gpu else)
    output, state = _launch(prefix, tmp_path, pairs_file, "--deepspeed", str(DS_ZERO3), "--use_cpu", "true")
    _assert_one_two_process_job(output, state)
    assert "ZeRO-3 leaf modules LlamaDecoderLayer" in output


def _gpu_config_on_two_cpu_processes(name: str, out: Path) -> Path:
    """A shipped GPU config as a user runs it on a CPU machine: 2 processes, ``use_cpu``, its bf16 kept."""
    data = yaml.safe_load((CONFIGS / name).read_text())
    data.update(use_cpu=True, num_processes=2, main_process_ip="127.0.0.1", main_process_port=free_port())
    path = out / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [("zero3.yaml", "ZeRO-3 leaf modules"), ("fsdp2.yaml", "FSDP2")])
def test_a_bf16_gpu_config_on_cpu_processes_trains_in_bf16_and_says_so(tmp_path, pairs_file, name, layout):
    """The config's mixed_precision bf16 applies on CPU too; an unset bf16 follows it (under DeepSpeed transformers
    would otherwise refuse the mismatch once the model is loaded), and the run summary names the precision."""
    config = _gpu_config_on_two_cpu_processes(name, tmp_path)
    assert yaml.safe_load(config.read_text())["mixed_precision"] == "bf16"
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    output, state = _launch(prefix, tmp_path, pairs_file)
    _assert_one_two_process_job(output, state)
    summary = next(line for line in output.splitlines() if line.startswith("pair_dpo: world_size="))
    assert "precision bf16 mixed" in summary and "on CPU" in summary and layout in summary


@pytest.mark.distributed
@pytest.mark.slow
def test_a_gpu_config_on_a_machine_without_gpus_is_refused_by_every_process(tmp_path, pairs_file):
    """``multi_gpu_ddp.yaml`` as a user runs it on a CPU-only machine (GPUs not hidden; 2 of its 8 processes, for the
    2 cores): every process refuses with ``no_gpu`` before loading, instead of training on the CPU in bf16."""
    if launch.accelerator_available():
        pytest.skip("this machine has an accelerator")
    config = CONFIGS / "multi_gpu_ddp.yaml"
    prefix = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    prefix += ["--num_processes", "2", "--main_process_port", str(free_port())]
    # torchrun stops the other processes once it sees one exit; polling every few seconds (not every 0.1 s) lets each
    # process reach its own refusal first, whatever its import time, so the check below sees both
    prefix += ["--monitor_interval", str(round(scaled(5.0), 1))]
    env = {k: v for k, v in _launch_env().items() if k != "CUDA_VISIBLE_DEVICES"}
    command = [*prefix, str(ROOT / "train.py"), *_train_args(tmp_path / "out", pairs_file)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    refusals = [line for line in output.splitlines() if line.startswith("train.py: error:")]
    assert done.returncode != 0 and len(refusals) == 2, output[-4000:]
    assert refusals[0].startswith(
        "train.py: error: [no_gpu] this run asks for GPUs (2 processes from the launcher; the accelerate config's "
        "mixed_precision: bf16) but torch sees none on this machine: pass --use_cpu True"
    )
    assert "pair_dpo: world_size=" not in output and "Loading weights" not in output
