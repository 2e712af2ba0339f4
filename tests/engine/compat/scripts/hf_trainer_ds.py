"""A Hugging Face Trainer fine-tuning script in the Stanford-Alpaca/FastChat shape: the DeepSpeed config goes
to `TrainingArguments(deepspeed=...)` with HF's "auto" values, and the Trainer drives DeepSpeed through
Accelerate. Nothing in it names deepfleet: `deepfleet run` makes its `deepspeed` resolve to the engine.
Rank 0 writes the Trainer's loss log to --out."""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--deepspeed", type=str, required=True)
parser.add_argument("--output_dir", type=str, required=True)
parser.add_argument("--resume_from", type=str, default=None)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--model", type=str, default=None, help="a save_pretrained folder to fine-tune")
parser.add_argument("--one_row", action="store_true", help="every sample the same (order-free losses)")
cli = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 128, (1 if cli.one_row else n, 16), generator=g).expand(n, 16)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
args = TrainingArguments(
    output_dir=cli.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
    learning_rate=1e-3, warmup_steps=1, logging_steps=1, save_strategy="steps", save_steps=3, report_to=[],
    deepspeed=cli.deepspeed, use_cpu=True, seed=0, dataloader_num_workers=0,
)
if cli.model:  # after TrainingArguments, so that at ZeRO-3 HF loads through deepspeed.zero.Init
    model = AutoModelForCausalLM.from_pretrained(cli.model)
    if cli.out:
        import deepspeed  # at ZeRO-3 the weights are partitioned placeholders: read them gathered, as with DeepSpeed

        weight = model.transformer.wte.weight
        with deepspeed.zero.GatheredParameters(weight):
            wte_sum = float(weight.detach().double().sum())
        with open(f"{cli.out}.rank{torch.distributed.get_rank()}", "w") as f:
            json.dump({"wte_sum": wte_sum}, f)
else:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train(resume_from_checkpoint=cli.resume_from)
trainer.save_model(cli.output_dir + "/final")
if trainer.is_world_process_zero() and cli.out:
    with open(cli.out, "w") as f:
        json.dump({"log": [h for h in trainer.state.log_history if "loss" in h],
                   "engine": type(trainer.model_wrapped).__module__}, f)
