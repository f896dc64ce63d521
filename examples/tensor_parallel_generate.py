"""Greedy generation with the model split over processes (tensor parallelism), accelerated by fastflow.

    torchrun --nproc-per-node 3 examples/tensor_parallel_generate.py                   # SmolLM2, 3 CPU ranks
    torchrun --nproc-per-node 3 examples/tensor_parallel_generate.py --quant int8 --check
    torchrun --nproc-per-node 2 examples/tensor_parallel_generate.py --model /path/to/hf_folder  # NCCL on GPUs

transformers shards the model as it loads (`tp_plan="auto"`: attention heads and MLP columns split over
the ranks, gloo on CPU, NCCL on CUDA; run one rank per GPU, or per CPU socket / NUMA node with
`OMP_NUM_THREADS` set to that node's cores). `ffl_backend.optimize` then turns the shards into plain
local tensors, keeps one all-reduce after each attention and MLP block, quantizes each rank's shard
and compiles decode with fastflow. The number of heads (and KV heads) must divide by the rank count.
With `--check`, rank 0 also runs the whole model in one process (unquantized, and quantized the same way)
and reports how many leading tokens agree.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _greedy(model, ids, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model folder (default: bundled SmolLM2-135M)")
    parser.add_argument("--quant", default=None, help="none (default), int8, int4, ...")
    parser.add_argument("--prompt", default="It is a truth universally acknowledged that")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--check", action="store_true", help="rank 0: compare with the whole model in one process")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ffl_backend
    from ffl_backend.bench.session import all_reduce_share

    folder = args.model or str(ffl_backend.smollm2_path())
    quant = None if args.quant in (None, "none") else args.quant
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    ffl_backend.optimize(model, quant=quant, max_seq_len=256)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(model.device)
    model.generate(ids, max_new_tokens=4, do_sample=False)  # compiles; later calls reuse the graphs
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    tokens = out[0, ids.shape[1]:]
    reduce = all_reduce_share(model, args.new_tokens / seconds, batch=1)  # a collective: every rank
    if rank == 0:
        print(f"{world} ranks, quant={quant}: {args.new_tokens / seconds:.1f} tok/s; one all-reduce of a hidden "
              f"vector {reduce['allreduce_us']:.0f} us, x{reduce['allreduce_per_step']} per step = "
              f"{reduce['allreduce_share_pct']:.0f}% of a step\n{tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    if args.check and rank == 0:
        whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        references = {"unquantized": _greedy(whole, ids, args.new_tokens)}
        if quant is not None:
            references[quant] = _greedy(ffl_backend.quantize(whole, quant), ids, args.new_tokens)
        for label, expected in references.items():
            print(f"the first {_common_prefix(expected, tokens)} of {args.new_tokens} tokens equal the "
                  f"{label} model's in one process (all equal: {torch.equal(expected, tokens)})")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
