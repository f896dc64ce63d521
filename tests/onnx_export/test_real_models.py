"""The real models through export_onnx (slow: each export takes one to two minutes): SmolLM2 in fp32 and
int4, ONNX Runtime GenAI on both folders, and Gemma-3 with a prompt longer than its sliding window."""
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_genai")
from ffl_backend.onnx import OnnxCausalLM, export_onnx  # noqa: E402
from ffl_backend.onnx.runtime import genai_greedy  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
NEW_TOKENS = 32


def without_eos(tokens: list[int], eos) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def test_smollm2_fp32_and_int4_in_onnxruntime_and_genai(tmp_path):
    from ffl_backend import load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    eos = [model.generation_config.eos_token_id]
    export_onnx(model, tmp_path / "fp32", tokenizer=tokenizer)
    plain = OnnxCausalLM(tmp_path / "fp32")
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        got = plain.generate(ids, NEW_TOKENS, eos_token_id=eos)
        with torch.no_grad():
            assert torch.equal(got, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)), text
        assert genai_greedy(tmp_path / "fp32", ids, NEW_TOKENS) == without_eos(got[0].tolist(), eos), text
    export_onnx(model, tmp_path / "int4", quant="int4-all", tokenizer=tokenizer)
    plain = OnnxCausalLM(tmp_path / "int4")
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        got = plain.generate(ids, NEW_TOKENS, eos_token_id=eos)
        assert genai_greedy(tmp_path / "int4", ids, NEW_TOKENS) == without_eos(got[0].tolist(), eos), text


def test_gemma3_fp32_honours_its_sliding_window(tmp_path):
    from ffl_backend import load_gemma3

    model, tokenizer = load_gemma3(dtype=torch.float32)
    window = model.config.get_text_config().sliding_window
    export_onnx(model, tmp_path, tokenizer=tokenizer)
    words = ("The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 80).split()
    ids = tokenizer(" ".join(words), return_tensors="pt").input_ids[:, : window + 64]
    assert ids.shape[1] > window
    got = OnnxCausalLM(tmp_path).generate(ids, NEW_TOKENS, eos_token_id=model.generation_config.eos_token_id)
    with torch.no_grad():
        assert torch.equal(got, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))
