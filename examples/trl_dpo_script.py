"""A TRL DPO training script, turned into pair DPO by changing 11 lines.

It started as the usual TRL script (``HfArgumentParser`` + TRL's ``DPOConfig`` + ``DPOTrainer``, optional LoRA through
``peft_config``). The diff below is the whole change (``-`` removed, ``+`` added; every other line of this file is as
it was)::

    -from trl import DPOConfig, DPOTrainer
    +from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
     ...
    +    # pair DPO: the reference is the starting model, verified against its pinned commit (pass yours).
    +    "ref_model_revision": DEMO_REVISION,
     ...
    -    parser = HfArgumentParser((ScriptArguments, DPOConfig))
    +    parser = HfArgumentParser((ScriptArguments, PairDPOConfig))
     ...
    -    trainer = DPOTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
    -                         peft_config=peft_config)
    +    trainer = PairDPOTrainer(
    +        model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    +    )

11 changed lines (4 removed, 7 added, comments included; the formatter split the new call). The dataset keeps its
``prompt`` / ``chosen`` / ``rejected`` columns and every ``DPOConfig`` flag this script uses keeps its name and
meaning (``--beta``, ``--loss_type``, ``--max_length``, ``--precompute_ref_log_probs``, ...); a TRL flag with no
twin here (``--padding_free``, ``--max_completion_length``, ``--rpo_alpha``, ...) is refused by the parser, and
``PairDPOConfig(padding_free=True)`` raises ``unsupported_option`` naming the equivalent. ``ref_model_revision`` is
the 40-hex commit the model directory was downloaded at, or what ``pair-dpo pin DIR`` printed for a directory you
saved yourself; the run verifies the directory against it before loading. docs/migrating_from_trl.md lists every
field, loss, metric and behaviour.

Run it (offline: the defaults are the bundled tiny Llama and the bundled demo pairs)::

    python examples/trl_dpo_script.py --max_steps 20
    python examples/trl_dpo_script.py --max_steps 20 --use_peft True
    accelerate launch examples/trl_dpo_script.py --model_name_or_path /models/my-sft \\
        --ref_model_revision <40-hex sha of /models/my-sft> --dataset_name pairs.jsonl --output_dir out
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path

DEFAULTS = {
    "output_dir": "outputs/trl-script",
    "max_steps": 10,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "max_length": 128,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    # pair DPO: the reference is the starting model, verified against its pinned commit (pass yours).
    "ref_model_revision": DEMO_REVISION,
}


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        default=str(bundled_model_dir()), metadata={"help": "Local directory of the starting (SFT) model."}
    )
    dataset_name: str = field(default=str(bundled_pairs_path()), metadata={"help": "A jsonl/json file of rows."})
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})


def main(argv: list[str] | None = None) -> None:
    """Parses the flags, loads model, tokenizer and data, trains, and saves the model and trainer state."""
    parser = HfArgumentParser((ScriptArguments, PairDPOConfig))
    parser.set_defaults(**DEFAULTS)
    script_args, training_args = parser.parse_args_into_dataclasses(sys.argv[1:] if argv is None else argv)

    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    dataset = load_dataset("json", data_files=script_args.dataset_name, split="train")
    peft_config = None
    if script_args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, target_modules="all-linear")

    trainer = PairDPOTrainer(
        model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
