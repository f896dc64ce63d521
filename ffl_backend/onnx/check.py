"""The post-export check: the written graph against PyTorch, within the computation's own error.

Float activations (accuracy level 0): logits of a prompt and two greedy decode steps equal PyTorch's
through nbits' reference up to fp32 rounding (1e-4 of the logits' size).

Level 4 (MatMulNBits quantizes its activations to int8 per block) cannot be checked at the logits:
each layer re-rounds its inputs, so a last-bit difference upstream moves codes downstream, and on a
30-layer model two exact implementations differ at the logits by as much as the rounding does in all
(SmolLM2 int4-all: ONNX Runtime vs PyTorch 1.37, level 4 vs level 0 in PyTorch 1.52, PyTorch against
itself with its activations moved by one ulp before rounding 1.39; docs/onnx.md). So level 4 is checked
where the rounding happens, layer by layer:
1. the same graph with every MatMulNBits at level 0 against PyTorch at level 0 (everything but the
   rounding: weights, attention, norms, the cache);
2. every MatMulNBits node of the graph as written, fed by ONNX Runtime itself (its inputs and outputs
   read from one run), against the reference on *those* inputs: the same input, so only two things
   may differ -- the fp32 sum of K products (at most 2 K u sum|x_q w| with u = 2^-24), and the
   activations that sit within a few ulps of a rounding boundary (|x/s - round(x/s)| within
   TIE_WINDOW of 1/2), which may round the other way, each by one step s: s |w| per such input.
   An export that skipped the rounding, or got a scale or zero point wrong, misses by far more.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import decoder, nbits

CHECK_FILE = "check.onnx"
TIE_WINDOW = 2.0 ** -18  # |x/s - round(x/s)| this close to 1/2 may round either way (scale by reciprocal)
U32 = 2.0 ** -24


def check_export(model, out: Path, accuracy_level: int = 4, prompt_len: int = 7, steps: int = 2) -> str:
    """The export in `out` against `model` (module docstring): logits of a prompt and `steps` greedy
    decode steps at float activations, and at level 4 every MatMulNBits node on its own inputs. Raises
    where they differ by more than the computation's own error allows; returns the one-line summary."""
    vocab = decoder.text_config(model.config).vocab_size
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    level4 = accuracy_level == nbits.INT8_ACTIVATIONS
    path = rewritten(out, level=0) if level4 else out / "model.onnx"
    try:
        worst, bound = _logits_error(model, out, path.name, ids, steps)
    finally:
        if level4:
            path.unlink(missing_ok=True)
    line = (f"ONNX export check: max |logits - PyTorch| = {worst:.3g} over a prompt and {steps} decode steps "
            f"(tolerance {bound:.3g}{', MatMulNBits at float activations' if level4 else ''})")
    if not worst <= bound:
        raise RuntimeError(line + ": the export does not compute the model")
    if level4:
        nodes, ratio = check_layers(out, ids)
        line += (f"; int8 activations: {nodes} MatMulNBits nodes each within {ratio:.2g} of its bound on its own "
                 "inputs")
    return line


def _logits_error(model, out: Path, model_file: str, ids, steps: int) -> tuple[float, float]:
    """(largest |logits - PyTorch's at float activations|, its bound: fp32 rounding, 1e-4 of the size)."""
    from .runtime import OnnxCausalLM

    session = OnnxCausalLM(out, model_file=model_file)
    got = _steps(lambda step_ids, past: _onnx_step(session, step_ids, past), ids, steps)
    ref = reference_steps(model, ids, steps, 0)
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    return worst, max(1e-4 * (1.0 + float(r.abs().max())) for r in ref)


def reference_steps(model, ids, steps: int, accuracy_level: int) -> list:
    """PyTorch's logits of a prompt and `steps` decode steps, quantized linears through nbits' reference."""
    with torch.no_grad(), nbits.as_matmul_nbits(model, accuracy_level):
        torch_side = decoder.KVDecoder(model).eval()
        return _steps(lambda step_ids, past: _torch_step(torch_side, step_ids, past), ids, steps)


def _steps(step, ids, steps: int) -> list:
    """Logits of a prompt and `steps` decode steps fed the tokens 1, 2, ... (the same for every side)."""
    logits, past = step(ids, None)
    out = [logits]
    for i in range(steps):
        logits, past = step(torch.full((ids.shape[0], 1), i + 1), past)
        out.append(logits)
    return out


def _onnx_step(session, ids, past):
    logits, present = session.step(ids, past)
    return torch.from_numpy(logits).float(), present


def _torch_step(torch_side, ids, past):
    layers = torch_side.layers
    if past is None:
        kv_heads, head_dim = decoder.cache_geometry(torch_side.model.config)[1:]
        dtype = next(torch_side.model.parameters()).dtype
        past = [torch.zeros(ids.shape[0], kv_heads, 0, head_dim, dtype=dtype) for _ in range(2 * layers)]
    total = past[0].shape[2] + ids.shape[1]
    mask = torch.ones(ids.shape[0], total, dtype=torch.long)
    positions = torch.arange(past[0].shape[2], total).expand(ids.shape[0], -1)
    logits, *present = torch_side(ids, mask, positions, *past)
    return logits.float(), present


def nbits_nodes(graph) -> list:
    return [node for node in graph.node if node.op_type == "MatMulNBits"]


def _attributes(node) -> dict:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def rewritten(folder: Path, *, level: int | None = None, expose: bool = False) -> Path:
    """A copy of folder/model.onnx as folder/CHECK_FILE (sharing its external weights): MatMulNBits
    at accuracy `level`, and/or with every MatMulNBits node's input and output as graph outputs."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    nodes = nbits_nodes(model.graph)
    for node in nodes:
        if level is not None:
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
    if expose:
        names = {name for node in nodes for name in (node.input[0], node.output[0])}
        model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                  for n in sorted(names))
    onnx.save(model, str(folder / CHECK_FILE))
    return folder / CHECK_FILE


def initializers(folder: Path) -> dict:
    """{name: TensorProto} of the export's weights."""
    import onnx

    return {t.name: t for t in onnx.load(str(folder / "model.onnx")).graph.initializer}


def node_weights(table: dict, node) -> dict:
    """A MatMulNBits node's initializers (B, scales, zero points, bias) as torch tensors."""
    from onnx import numpy_helper

    names = ("b", "scales", "zeros", None, "bias")  # MatMulNBits: A, B, scales, zero_points, g_idx, bias
    return {key: torch.from_numpy(numpy_helper.to_array(table[name]).copy())
            for key, name in zip(names, node.input[1:]) if key is not None and name}


def layer_errors(x: torch.Tensor, y: torch.Tensor, weights: dict, attrs: dict) -> tuple[float, float]:
    """(largest |y - reference(x)|, the bound it is held to at that element) for one MatMulNBits node
    at level 4 fed `x`, which returned `y` (module docstring, item 2)."""
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    w = nbits.dequantize(weights["b"], weights["scales"], weights["zeros"], k, n, attrs["bits"], block).double()
    x2 = x.reshape(-1, k).double()
    padded = torch.nn.functional.pad(x2, (0, -k % block)).reshape(x2.shape[0], -1, block)
    scale = padded.abs().amax(-1, keepdim=True) / 127.0
    steps = (padded / torch.where(scale > 0, scale, 1.0))
    xq = (torch.round(steps) * scale).reshape(x2.shape[0], -1)[:, :k]
    near_tie = ((steps - torch.floor(steps) - 0.5).abs() <= TIE_WINDOW * (1 + steps.abs()))
    flip = (near_tie * scale).reshape(x2.shape[0], -1)[:, :k]
    ref = xq @ w.T
    if "bias" in weights:
        ref = ref + weights["bias"].double()
    bound = 2 * k * U32 * (xq.abs() @ w.abs().T) + flip @ w.abs().T + 1e-6 * (1 + ref.abs())
    err = (y.reshape(-1, n).double() - ref).abs()
    worst = int((err / bound).argmax())
    return float(err.flatten()[worst]), float(bound.flatten()[worst])


def check_layers(folder: Path, ids: torch.Tensor) -> tuple[int, float]:
    """(nodes checked, the largest error / bound ratio) of every MatMulNBits node at level 4 on a
    prompt `ids`, each against the reference on its own input. Raises where a node exceeds its bound."""
    import onnx
    import onnxruntime as ort

    path = rewritten(folder, expose=True)
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = _prompt_feeds(session, folder, ids)
        names = [o.name for o in session.get_outputs()]
        values = dict(zip(names, session.run(names, feeds)))
        worst, table = 0.0, initializers(folder)
        for node in nbits_nodes(graph):
            err, bound = layer_errors(torch.from_numpy(values[node.input[0]]), torch.from_numpy(values[node.output[0]]),
                                      node_weights(table, node), _attributes(node))
            if not err <= bound:
                raise RuntimeError(f"MatMulNBits node {node.name} at level 4 is {err:.3g} from the reference on "
                                   f"its own inputs, beyond the {bound:.3g} that fp32 sums and ties allow")
            worst = max(worst, err / bound)
        return len(nbits_nodes(graph)), worst
    finally:
        path.unlink(missing_ok=True)


def _prompt_feeds(session, folder: Path, ids: torch.Tensor) -> dict:
    from transformers import AutoConfig

    layers, kv_heads, head_dim = decoder.cache_geometry(AutoConfig.from_pretrained(folder))
    past = [np.zeros((ids.shape[0], kv_heads, 0, head_dim), np.float32) for _ in range(2 * layers)]
    positions = np.arange(ids.shape[1], dtype=np.int64)[None].repeat(ids.shape[0], 0)
    values = [ids.numpy().astype(np.int64), np.ones(ids.shape, np.int64), positions, *past]
    return dict(zip(decoder.input_names(layers), values))
