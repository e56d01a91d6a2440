"""Loading the policy by path under ``TrainingArguments(deepspeed=<ZeRO-3 config>)``: DeepSpeed's communication first.

With a ZeRO-3 config in ``TrainingArguments.deepspeed`` (``torchrun train.py --deepspeed ds_zero3.json``, the HF way),
``from_pretrained`` builds the model inside ``deepspeed.zero.Init``, whose ``DeepSpeedConfig`` checks
``train_batch_size == micro_batch * GA * world_size`` with the world size of ``deepspeed.comm``. When accelerate set up
the process group without DeepSpeed's help (``use_cpu=True``: a plain gloo group), ``deepspeed.comm`` is not
initialised yet, that world size reads 1, and loading died with ``train_batch_size is not equal to micro_batch_per_gpu
* gradient_acc_step * world_size 32 != 8 * 2 * 1``. :func:`ensure_deepspeed_comm` initialises ``deepspeed.comm`` over
the existing process group (no second group) before the load.
"""

from __future__ import annotations

import torch


def ensure_deepspeed_comm() -> None:
    """Initialises ``deepspeed.comm`` when a ZeRO-3 load is about to run and it is not initialised; else nothing."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        return
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    ds_comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
