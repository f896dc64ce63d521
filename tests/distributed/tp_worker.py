"""One rank of a tensor-parallel check, launched by tests/test_tensor_parallel.py under torch.distributed.run.

Loads each of `--folders` with transformers' `tp_plan="auto"` (gloo on CPU) once per case, runs the case's
entry point on it and greedy-generates `--new-tokens` from `--prompt`; every rank writes
{"<folder>|<case>": tokens or the error message} as JSON to `--out`/rank<N>.json.
Cases are "<entry>:<quant>": entry compile (torch.compile(model, backend="fastflow") with quantize() first
when quant is set), model_compile (model.compile(backend="fastflow")), optimize (optimize(model, quant=...)),
eager (plain generate), logits (localize, or quantize, then the last position's logits instead of tokens);
quant none, int8 or int4.
"""
import argparse
import json
import os
import pathlib

import torch
import torch.distributed as dist


def run_case(folder: str, case: str, prompt: torch.Tensor, new_tokens: int):
    from transformers import AutoModelForCausalLM

    import ffl_backend
    from ffl_backend.quant.tensor_parallel import localize

    entry, quant = case.split(":")
    quant = None if quant == "none" else quant
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
    if entry == "logits":  # the localized model's last-position logits, eager
        if quant is not None:
            ffl_backend.quantize(model, quant)
        else:
            localize(model)
        with torch.no_grad():
            return model(prompt).logits[0, -1].tolist()
    if entry == "optimize":
        model = ffl_backend.optimize(model, quant=quant, mode="default")
    elif quant is not None:
        ffl_backend.quantize(model, quant)
    if entry == "compile":
        model.forward = torch.compile(model.forward, backend="fastflow")
    elif entry == "model_compile":
        model.compile(backend="fastflow")
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return out[0, prompt.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folders", nargs="+", required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--prompt", type=int, nargs="+", required=True)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    prompt = torch.tensor([args.prompt])
    results = {}
    for folder in args.folders:
        for case in args.cases:
            try:
                results[f"{folder}|{case}"] = run_case(folder, case, prompt, args.new_tokens)
            except Exception as exc:  # reported to the test, which shows it
                results[f"{folder}|{case}"] = f"{type(exc).__name__}: {exc}"
            torch._dynamo.reset()
    rank = int(os.environ["RANK"])
    pathlib.Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
