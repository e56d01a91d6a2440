"""An ordinary Hugging Face fine-tuning script, turned into pair DPO by changing 14 lines.

It started as the usual causal-LM script (``HfArgumentParser`` + ``TrainingArguments`` + ``Trainer``) that
fine-tuned on the ``chosen`` answers. The diff below is the whole change (``-`` removed, ``+`` added; every other
line of this file is as it was)::

    -from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
    +from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
     ...
    +    # pair DPO: the reference is the starting model, verified against its pinned commit (pass yours).
    +    "ref_model_revision": DEMO_REVISION,
     ...
    -    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    +    parser = HfArgumentParser((ModelArguments, DataArguments, PairDPOConfig))
     ...
    -    def to_features(row):  # SFT: learn the chosen conversation
    -        return tokenizer.apply_chat_template(row["prompt"] + row["chosen"], return_dict=True)
    -    dataset = dataset.map(to_features, remove_columns=dataset.column_names)
    -    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    -    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator,
    -                      processing_class=tokenizer)
    +    # pair DPO: rows stay {prompt, chosen, rejected}; the trainer tokenises, packs and batches them.
    +    trainer = PairDPOTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)

14 changed lines (8 removed, 6 added, comments included). The dataset keeps its ``prompt`` / ``chosen`` /
``rejected`` columns; the tokenising ``map`` and the language-modelling collator go away, and every other
``TrainingArguments`` flag keeps its meaning (``per_device_train_batch_size`` now counts preference pairs).
``ref_model_revision`` is the 40-hex commit the model directory was downloaded at
(``hf download REPO --revision SHA --local-dir DIR``); the run verifies the directory against it before loading.

Run it (offline: the defaults are the bundled tiny Llama and the bundled demo pairs)::

    python examples/existing_trainer_script.py --max_steps 20
    accelerate launch examples/existing_trainer_script.py --model_name_or_path /models/my-sft \\
        --ref_model_revision <40-hex sha of /models/my-sft> --train_file pairs.jsonl --output_dir out

Every ``PairDPOConfig`` field (``--beta``, ``--loss_type``, ``--reference_free``, ...) is a command-line flag.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path

DEFAULTS = {
    "output_dir": "outputs/existing-script",
    "max_steps": 10,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-3,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    # pair DPO: the reference is the starting model, verified against its pinned commit (pass yours).
    "ref_model_revision": DEMO_REVISION,
}


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=str(bundled_model_dir()), metadata={"help": "Local directory of the starting model."}
    )


@dataclass
class DataArguments:
    train_file: str = field(default=str(bundled_pairs_path()), metadata={"help": "A jsonl/json file of rows."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N rows."})


def main(argv: list[str] | None = None) -> None:
    """Parses the flags, loads model, tokenizer and data, trains, and saves the model and trainer state."""
    parser = HfArgumentParser((ModelArguments, DataArguments, PairDPOConfig))
    parser.set_defaults(**DEFAULTS)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(sys.argv[1:] if argv is None else argv)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    dataset = load_dataset("json", data_files=data_args.train_file, split="train")
    if data_args.max_train_samples is not None:
        dataset = dataset.select(range(min(data_args.max_train_samples, len(dataset))))

    # pair DPO: rows stay {prompt, chosen, rejected}; the trainer tokenises, packs and batches them.
    trainer = PairDPOTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
