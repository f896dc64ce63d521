"""quantize() copies the layers it keeps out of the checkpoint's memory mapping, so the mapping (and
the pages of the weights it replaced) can be released."""
import gc
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import ffl_backend
from ffl_backend.quant import file_pages
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _mapped(path) -> bool:
    return any(line.rstrip().endswith(str(path)) for line in open("/proc/self/maps"))


@pytest.fixture
def saved_llama(tmp_path):
    """A tiny bf16 Llama with tied embedding and lm_head (as SmolLM2), saved as safetensors."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    return tmp_path


def test_quantize_releases_the_checkpoint_mapping_and_keeps_results(saved_llama):
    ids = torch.randint(3, 128, (1, 12))
    in_memory = AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.bfloat16).eval()
    for p in in_memory.parameters():
        p.data = p.data.clone()  # the same model, none of it in the file
    model = AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.bfloat16).eval()
    weights = saved_llama / "model.safetensors"
    assert _mapped(weights)
    ranges = file_pages._file_mappings()
    assert any(file_pages._in_mapping(p, ranges) for p in model.parameters())

    ffl_backend.quantize(model, "int8")
    ffl_backend.quantize(in_memory, "int8")
    gc.collect()
    assert not _mapped(weights)
    ranges = file_pages._file_mappings()
    assert not any(file_pages._in_mapping(t, ranges) for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor, now in memory
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, in_memory(ids).logits, rtol=0, atol=0)


def test_tensors_outside_mappings_and_skipped_modules_are_not_copied(saved_llama):
    model = AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.bfloat16).eval()
    norm = model.model.norm
    assert file_pages.copy_out_of_file_mappings(model, skip=(type(norm),)) > 0
    ranges = file_pages._file_mappings()
    assert file_pages._in_mapping(norm.weight, ranges)  # skipped module: still the file's
    before = [p.data_ptr() for p in model.parameters()]
    assert file_pages.copy_out_of_file_mappings(torch.nn.Linear(4, 4)) == 0
    assert [p.data_ptr() for p in model.parameters()] == before
