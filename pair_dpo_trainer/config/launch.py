"""What the launcher and the hardware decide: the bf16 default, CPU for a CPU-only multi-process launch, the check
that the launched processes form one job, and the check that an elastic launch can restart.

``PairDPOConfig.__post_init__`` calls :func:`precision_problem`, :func:`no_gpu_problem`, :func:`resolve_use_cpu` and
:func:`resolve_bf16` before ``TrainingArguments.__post_init__`` sets up the device, and :func:`launch_problem` and
:func:`elastic_restart_problem` after it.

Why the precision follows the launcher: an accelerate config's ``mixed_precision`` (``ACCELERATE_MIXED_PRECISION``)
applies to the run whatever ``bf16`` says (``TrainingArguments`` keeps it unless ``bf16`` / ``fp16`` is set), and
under DeepSpeed accelerate writes it into the DeepSpeed configuration, which transformers then compares with
``bf16`` and refuses with a bare ``ValueError`` once the model is loaded. So an unset ``bf16`` follows the launcher
(bf16 on CPU too), and an explicit contradiction is refused at once (``precision_mismatch``).

Why the last two exist: on a machine without an accelerator, ``torchrun --nproc_per_node 2 train.py`` (and
``accelerate launch`` with a DDP config, which runs torchrun) starts processes that accelerate's ``PartialState``
does not join into one job unless ``use_cpu=True`` (it finds no GPU backend and falls back to "not distributed"):
two independent world-size-1 trainings (the ``deepspeed`` launcher and ``torchrun ... --deepspeed`` too). Several
processes (or bf16) on a machine without GPUs are what a GPU config asks for, so they are refused (``no_gpu``) unless
the user chose the CPU (``--use_cpu True``, or every GPU hidden with ``CUDA_VISIBLE_DEVICES=``); then ``use_cpu``
becomes True and the processes form one gloo job. Any other
launch whose processes still do not form one job (e.g. accelerate's ``MULTI_CPU`` type without ``mpirun``, which
starts ONE process for ``num_processes: 2``) raises ``launch_not_one_job`` instead of training alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.utils import is_torch_bf16_gpu_available

# Environment variables that carry the number of processes of the job (torchrun / deepspeed launcher, then MPI).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# Mixed precisions an accelerate config (ACCELERATE_MIXED_PRECISION) can ask for that are not bf16.
_OTHER_PRECISIONS = ("fp16", "fp8")


def resolve_bf16(bf16: bool | None, *, fp16: bool, use_cpu: bool, env: Mapping[str, str]) -> bool:
    """The value of ``bf16`` when the user left it unset (``None``), else the user's value.

    Unset, bf16 mixed precision is on when the launcher asks for it (``ACCELERATE_MIXED_PRECISION=bf16`` from an
    accelerate config, also on CPU: see the module docstring), and otherwise exactly when the run can use it and
    nothing else was asked for: not ``fp16``, not ``use_cpu``, an accelerator with bf16 support (transformers'
    ``is_torch_bf16_gpu_available``, the check ``TrainingArguments`` itself applies to ``bf16=True``), and no other
    precision from the launcher (``fp16`` / ``fp8``). Other CPU runs stay float32.

    Args:
        bf16: The configured value; ``None`` means unset.
        fp16: The configured ``fp16``.
        use_cpu: The configured ``use_cpu``.
        env: The process environment.
    """
    if bf16 is not None:
        return bool(bf16)
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launcher == "bf16" and not fp16:
        return True
    if fp16 or use_cpu or launcher in _OTHER_PRECISIONS:
        return False
    return bool(is_torch_bf16_gpu_available())


def precision_problem(bf16: bool | None, *, fp16: bool, env: Mapping[str, str]) -> str | None:
    """Why the configured precision contradicts the launcher's (``ACCELERATE_MIXED_PRECISION``), or None.

    Args:
        bf16: The configured ``bf16`` (None: unset, it follows the launcher).
        fp16: The configured ``fp16``.
        env: The process environment.
    """
    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launcher == "bf16" and (bf16 is False or fp16):
        asked = "fp16=True" if fp16 else "bf16=False"
    elif launcher in _OTHER_PRECISIONS and bf16:
        asked = "bf16=True"
    else:
        return None
    return (
        f"the launcher's accelerate config asks for mixed_precision {launcher} (ACCELERATE_MIXED_PRECISION), but the "
        f"run sets {asked}: leave bf16 / fp16 unset to follow the launcher, or set mixed_precision to match in the "
        "accelerate config (mixed_precision: 'no' for float32)."
    )


def launcher_world_size(env: Mapping[str, str]) -> int:
    """The number of processes the launcher started for this job (1 when no launcher says otherwise)."""
    for name in WORLD_SIZE_VARIABLES:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 1


def accelerator_available() -> bool:
    """True when torch sees an accelerator (CUDA, XPU, ...) that a distributed backend can run on."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def gpus_hidden(env: Mapping[str, str]) -> bool:
    """True when the launch hides every GPU on purpose: ``CUDA_VISIBLE_DEVICES`` set and empty."""
    return "CUDA_VISIBLE_DEVICES" in env and not env["CUDA_VISIBLE_DEVICES"].strip()


def gpu_requests(bf16: bool | None, *, env: Mapping[str, str]) -> dict[str, str]:
    """What asks this run for GPUs, each with the way to run without them: several processes (``WORLD_SIZE``),
    ``bf16=True``, or the accelerate config's ``mixed_precision: bf16`` with ``bf16`` unset.

    Args:
        bf16: The configured ``bf16`` (None: unset).
        env: The process environment.
    """
    requests = {}
    processes = launcher_world_size(env)
    if processes > 1:
        requests[f"{processes} processes from the launcher"] = "one process, without a launcher (python train.py)"
    if bf16:
        requests["--bf16 True"] = "without --bf16 True (float32 on the CPU)"
    elif bf16 is None and env.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "bf16":
        requests["the accelerate config's mixed_precision: bf16"] = "with a config whose mixed_precision is 'no'"
    return requests


def no_gpu_problem(bf16: bool | None, *, use_cpu: bool, env: Mapping[str, str]) -> str | None:
    """Why a run that asks for GPUs (:func:`gpu_requests`) cannot start on this machine, or None.

    A machine where torch sees no accelerator runs such a run on the CPU only when the user chose the CPU: ``use_cpu``
    (``--use_cpu True``), or every GPU hidden (``CUDA_VISIBLE_DEVICES=``, :func:`gpus_hidden`). Without that choice
    an 8-GPU config would start 8 CPU processes in bf16, and ``bf16=True`` alone would be refused by
    ``TrainingArguments`` with a bare ``ValueError``: both get this one answer.

    Args:
        bf16: The configured ``bf16`` (None: unset).
        use_cpu: The configured ``use_cpu``.
        env: The process environment.
    """
    if use_cpu or gpus_hidden(env):
        return None
    requests = gpu_requests(bf16, env=env)
    if not requests or accelerator_available():
        return None
    instead = next(iter(requests.values()))  # several processes first: one process also drops the launcher's bf16
    return (
        f"this run asks for GPUs ({'; '.join(requests)}) but torch sees none on this machine: pass --use_cpu True to "
        f"train on the CPU anyway (slow), or run {instead}."
    )


def resolve_use_cpu(use_cpu: bool, *, env: Mapping[str, str], bf16: bool | None = None) -> bool:
    """``use_cpu``, switched on on a machine without an accelerator for a run whose CPU use :func:`no_gpu_problem`
    accepted: a multi-process launch (the processes form one gloo job), or bf16 with every GPU hidden
    (``TrainingArguments`` takes bf16 on the CPU only with ``use_cpu``). Also under DeepSpeed: without it accelerate
    counts a DeepSpeed job on the CPU as one process (``PartialState`` finds no GPU backend) although DeepSpeed joined
    the processes.

    Args:
        use_cpu: The configured ``use_cpu``.
        env: The process environment.
        bf16: The configured ``bf16`` (None: unset).
    """
    if use_cpu or not gpu_requests(bf16, env=env):
        return use_cpu
    return not accelerator_available()


def launch_problem(world_size: int, env: Mapping[str, str]) -> str | None:
    """Why the launched processes do not form one job, or None when they do.

    Args:
        world_size: The world size ``TrainingArguments`` set up (``args.world_size``).
        env: The process environment.
    """
    expected = launcher_world_size(env)
    if expected > 1 and world_size != expected:
        return (
            f"the launcher started {expected} processes (WORLD_SIZE={expected}) but they did not join one job "
            f"(world_size={world_size} here): each would train alone on the same output_dir. On a machine without "
            "GPUs pass --use_cpu True; with GPUs check that every process sees one (CUDA_VISIBLE_DEVICES)."
        )
    intended_many = "MASTER_PORT" in env and "ACCELERATE_USE_CPU" in env  # set by accelerate's one-process launcher
    if world_size == 1 and expected == 1 and intended_many:
        return (
            "accelerate launched ONE process for a multi-process config (its MULTI_CPU / --cpu launcher starts one "
            "process unless run under mpirun): use accelerate_configs/cpu_2proc.yaml (torchrun-based) or "
            "`torchrun --nproc_per_node N train.py`, or set num_processes: 1."
        )
    return None


def elastic_restart_problem(env: Mapping[str, str]) -> str | None:
    """Why an elastic launch that may restart its workers (``torchrun --max-restarts N``, N > 0) cannot, or None.

    torchrun's restarted workers must find a fresh key-value store. With the store its agent shares with the workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``: a static rendezvous always, c10d unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) the second attempt's process group reads the first attempt's addresses
    (torch 2.13, pytorch/pytorch#135712): on c10d it fails to connect and ends the job, on static it waits forever.

    Args:
        env: The process environment (what torchrun set for this worker).
    """
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if not restarts.isdigit() or int(restarts) == 0:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() != "true":
        return None
    return (
        f"this launch may restart its workers (TORCHELASTIC_MAX_RESTARTS={restarts}) but they share the launcher's "
        "key-value store (TORCHELASTIC_USE_AGENT_STORE=True): a restarted worker group would read the failed attempt's "
        "addresses and never connect, so the restart meant to save the job would end it. Launch with "
        "--rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's environment (or without "
        "--max-restarts)."
    )
