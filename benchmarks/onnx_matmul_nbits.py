"""ONNX Runtime's MatMulNBits on this CPU: one layer, one token (M=1), by weight bits, zero-point kind
and accuracy_level, against a float32 MatMul of the same shape. Why export_onnx writes uint8 zero
points and defaults to accuracy_level 4 (docs/onnx.md).

    python benchmarks/onnx_matmul_nbits.py [--out benchmarks/results/onnx_matmul_nbits_cpu_<cpu>.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def _session(nodes, inits, k: int, n: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def nbits_session(k, n, bits, zero_points, level, block, threads):
    from onnx import helper, numpy_helper

    blocks = k // block
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), "B"),
             numpy_helper.from_array((rng.random((n, blocks)) * 0.01).astype(np.float32), "S")]
    names = ["A", "B", "S"]
    if zero_points == "uint8":
        inits.append(numpy_helper.from_array(np.zeros((n, (blocks * bits + 7) // 8), np.uint8), "Z"))
        names.append("Z")
    elif zero_points == "float":
        inits.append(numpy_helper.from_array((rng.random((n, blocks)) * 15).astype(np.float32), "Z"))
        names.append("Z")
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)
    return _session([node], inits, k, n, threads)


def matmul_session(k, n, threads):
    from onnx import helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).random((k, n), dtype=np.float32), "W")
    return _session([helper.make_node("MatMul", ["A", "W"], ["Y"])], [weight], k, n, threads)


def time_us(session, k: int, calls: int) -> float:
    x = {"A": np.random.default_rng(1).standard_normal((1, k), dtype=np.float32)}
    for _ in range(20):
        session.run(None, x)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            session.run(None, x)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return float(np.median(times))


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [{"op": "MatMul float32", "us": time_us(matmul_session(args.k, args.n, args.threads), args.k, args.calls)}]
    for bits, block in ((4, 64), (8, 32)):
        for zero_points in ("none", "uint8", "float"):
            for level in (0, 4):
                row = {"op": "MatMulNBits", "bits": bits, "block_size": block, "zero_points": zero_points,
                       "accuracy_level": level}
                try:
                    session = nbits_session(args.k, args.n, bits, zero_points, level, block, args.threads)
                    row["us"] = time_us(session, args.k, args.calls)
                except Exception as exc:  # ONNX Runtime refuses 8-bit weights with float zero points
                    row["error"] = str(exc).splitlines()[0][-160:]
                rows.append(row)
                print(row)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    result = {"cpu": cpu, "threads": args.threads, "onnxruntime": ort.__version__, "K": args.k, "N": args.n, "M": 1,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
