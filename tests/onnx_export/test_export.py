"""export_onnx on tiny models of every architecture: ONNX Runtime's greedy tokens equal PyTorch eager's,
sliding windows are honoured, quantized exports are fastflow's quantized model, ONNX Runtime GenAI
loads the folder unchanged, and what cannot be exported says why before any work."""
import io
import json
import logging
import re
import sys
import types

import pytest
import torch

from tests.tiny_models import ARCHS, VOCAB, sliding_model, tiny_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
from ffl_backend.onnx import OnnxCausalLM, export_onnx  # noqa: E402
from ffl_backend.onnx.runtime import genai_greedy  # noqa: E402

NEW_TOKENS = 32


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def greedy_reference(model, ids, new_tokens=NEW_TOKENS):
    """HF generate, greedy; EOS stops it as it stops OnnxCausalLM.generate."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)


def prompt(length=9, seed=0):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def onnx_greedy(folder, ids, model):
    return OnnxCausalLM(folder).generate(ids, NEW_TOKENS, eos_token_id=model.generation_config.eos_token_id)


# The fast set exports one architecture; --slow every one (docs/testing.md).
@pytest.mark.parametrize("arch", [a if a == "llama" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def test_every_architecture_exports_and_generates_eagers_tokens(arch, tmp_path, monkeypatch, caplog):
    model = tiny_model(arch)
    stderr = FakeTTY()  # a terminal: the bar over the export's phases is shown
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.delenv("FFL_PROGRESS", raising=False)
    caplog.set_level(logging.INFO, logger="ffl_backend")
    export_onnx(model, tmp_path)
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastflow: ONNX export")]
    assert len(summary) == 1 and re.fullmatch(r"fastflow: ONNX export [\d.]+ s: export [\d.]+ s, fuse [\d.]+ s, "
                                              r"write [\d.]+ s, check [\d.]+ s", summary[0]), summary
    assert re.search(r"ONNX export: check: 100%\|.*\| (\d+)/\1 ", stderr.getvalue())
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is False
    for seed, length in ((0, 9), (1, 1)):  # a one-token prompt too: every dimension of the trace was > 1
        ids = prompt(length, seed)
        assert torch.equal(onnx_greedy(tmp_path, ids, model), greedy_reference(model, ids)), (arch, length)


@pytest.mark.slow
def test_sliding_window_is_honoured(tmp_path):
    """Gemma-2's layout (sliding and global layers alternate); the real Gemma-3 in test_real_models."""
    model = sliding_model("gemma2", window=6)
    export_onnx(model, tmp_path)
    ids = prompt(12)
    assert torch.equal(onnx_greedy(tmp_path, ids, model), greedy_reference(model, ids))
    logits = OnnxCausalLM(tmp_path).logits(ids)
    model.config.sliding_window = 4096  # the same weights without the window: other logits
    with torch.no_grad():
        unwindowed = model(ids).logits
    assert (logits[0, -1] - unwindowed[0, -1]).abs().max() > 1e-3


# The fast set exports int4 (fitted grids, fractional zero points); --slow int8-all too.
@pytest.mark.parametrize("quant", ["int4", pytest.param("int8-all", marks=pytest.mark.slow)])
def test_quantized_export_is_fastflows_quantized_model(quant, tmp_path):
    """Float activations (level 0): the export computes exactly fastflow's weights, so ONNX Runtime's
    greedy tokens equal those of PyTorch's quantized model; the default level 4 (int8 activations) is
    checked by export_onnx itself layer by layer (the tests below)."""
    model = tiny_model("qwen2")
    export_onnx(model, tmp_path, quant=quant, accuracy_level=0)
    import onnx

    ops = {node.op_type for node in onnx.load(tmp_path / "model.onnx").graph.node}
    assert "MatMulNBits" in ops
    for seed in range(2):
        ids = prompt(9, seed)
        assert torch.equal(onnx_greedy(tmp_path, ids, model), greedy_reference(model, ids))


def test_level_4_check_fails_an_export_that_skips_the_activation_rounding(tmp_path):
    """The graph written at level 0 (float activations) computes the model to fp32 rounding, but it is
    not what level 4 means: checked as level 4, its MatMulNBits nodes miss their per-layer bound. The
    same export checked as what it is passes, and so does the level-4 export (export_onnx checks it)."""
    from ffl_backend.onnx import check_export

    model = tiny_model("llama")
    export_onnx(model, tmp_path / "level0", quant="int4", accuracy_level=0, fuse=False)
    assert "MatMulNBits at float" not in check_export(model, tmp_path / "level0", accuracy_level=0)
    with pytest.raises(RuntimeError, match="MatMulNBits node .* at level 4 is .* beyond"):
        check_export(model, tmp_path / "level0", accuracy_level=4)
    export_onnx(model, tmp_path / "level4", fuse=False)  # quantized already; level 4 is the default
    assert "MatMulNBits nodes each within" in check_export(model, tmp_path / "level4", accuracy_level=4)


def test_level_4_check_fails_an_export_with_a_dropped_scale(tmp_path):
    """One int4 group's scale written as 1 (dropped) in the graph: the logits at float activations move
    by more than fp32 rounding, and the check says so."""
    import onnx
    from onnx import numpy_helper

    from ffl_backend.onnx import check_export

    model = tiny_model("llama")
    export_onnx(model, tmp_path, quant="int4", fuse=False)
    graph = onnx.load(str(tmp_path / "model.onnx"))
    node = next(n for n in graph.graph.node if n.op_type == "MatMulNBits")
    scales = next(t for t in graph.graph.initializer if t.name == node.input[2])
    values = numpy_helper.to_array(scales).copy()
    values.flat[0] = 1.0
    scales.CopyFrom(numpy_helper.from_array(values, scales.name))
    onnx.save(graph, str(tmp_path / "model.onnx"))
    with pytest.raises(RuntimeError, match="does not compute the model"):
        check_export(model, tmp_path, accuracy_level=4)


def test_cli_export_loads_in_onnxruntime_genai_with_the_same_tokens(tmp_path):
    """ffl-export-onnx --quant int4 (accuracy level 4, checked), then GenAI on the folder unchanged."""
    pytest.importorskip("onnxruntime_genai")
    from ffl_backend.onnx.cli import main

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    assert main([str(tmp_path / "hf"), str(out), "--quant", "int4"]) == 0
    written = {p.name for p in out.iterdir()}
    assert {"model.onnx", "config.json", "genai_config.json", "tokenizer_config.json"} <= written
    assert main([str(tmp_path / "hf"), str(tmp_path / "fp8"), "--quant", "fp8"]) == 2
    plain = OnnxCausalLM(out)
    for seed in range(3):
        ids = prompt(9, seed)
        tokens = torch.tensor(genai_greedy(out, ids, NEW_TOKENS))
        expected = plain.generate(ids, NEW_TOKENS, eos_token_id=model.generation_config.eos_token_id)[0]
        if expected[-1] == model.generation_config.eos_token_id:
            expected = expected[:-1]  # GenAI's sequence ends before the EOS it stopped at
        assert torch.equal(tokens, expected), seed


def test_what_cannot_be_exported_says_why_before_any_work(tmp_path):
    unknown = types.SimpleNamespace(config=types.SimpleNamespace(model_type="mamba"))
    with pytest.raises(ValueError, match="cannot export to ONNX: model_type 'mamba'") as info:
        export_onnx(unknown, tmp_path)
    assert "\n" not in str(info.value)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no ONNX Runtime weight format"):
        export_onnx(model, tmp_path, quant="w8a8")
    with pytest.raises(ValueError, match="float32"):
        export_onnx(tiny_model("llama", dtype=torch.bfloat16), tmp_path)
    assert list(tmp_path.iterdir()) == []
