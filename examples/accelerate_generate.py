"""Greedy generation under `accelerate launch`, accelerated by fastflow.

    accelerate launch --cpu --num_processes 2 examples/accelerate_generate.py            # SmolLM2-135M
    accelerate launch --cpu --num_processes 2 examples/accelerate_generate.py --tiny     # random tiny Llama
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_generate.py --tiny

Accelerate 1.16 runs `--cpu --num_processes 2` as a single process (its simple launcher fans out only
through mpirun with a hostfile); the last line gives two real CPU ranks (torchrun + gloo).

The recipe: Accelerate's `DynamoBackend` is a closed enum, so "fastflow" cannot be its dynamo backend
(`Accelerator(dynamo_backend=...)`, `--dynamo_backend`, `ACCELERATE_DYNAMO_BACKEND` all reject it).
Keep Accelerate's dynamo at "no", let it `prepare` the model (device placement, DDP wrapper), then
`ffl_backend.optimize` the unwrapped model: `generate` then decodes over a static cache compiled with
fastflow in every process. Each process here generates for its own prompt and checks its tokens
against the same model run eagerly.
"""
from __future__ import annotations

import argparse

import torch


def tiny_model_and_prompts(rank: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)  # the same weights in every process
    config = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 128, (1, 7 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    return model, ids, None


def smollm2_and_prompts(rank: int):
    import ffl_backend

    model, tokenizer = ffl_backend.load_smollm2()
    prompts = ["The capital of France is", "It is a truth universally acknowledged that"]
    ids = tokenizer(prompts[rank % len(prompts)], return_tensors="pt").input_ids
    return model, ids, tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of SmolLM2-135M")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    from accelerate import Accelerator

    import ffl_backend

    accelerator = Accelerator()  # dynamo_backend stays "no": see the module docstring
    build = tiny_model_and_prompts if args.tiny else smollm2_and_prompts
    model, ids, tokenizer = build(accelerator.process_index)
    greedy = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.inference_mode():
        expected = model.generate(ids, **greedy)

    model = accelerator.prepare(model)
    model = ffl_backend.optimize(accelerator.unwrap_model(model), max_seq_len=256)
    ids = ids.to(accelerator.device)
    with torch.inference_mode():
        out = model.generate(ids, **greedy)

    same = torch.equal(out.cpu(), expected)
    graphs = len(ffl_backend.fusion_reports())
    text = tokenizer.decode(out[0, ids.shape[1]:]) if tokenizer else out[0, ids.shape[1]:].tolist()
    print(f"rank {accelerator.process_index}: {text!r} equal_to_eager={same} fastflow_graphs={graphs}", flush=True)
    accelerator.wait_for_everyone()
    return 0 if same and graphs > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
