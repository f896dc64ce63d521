"""quantize() copies the layers it keeps out of the checkpoint's memory mapping, so the mapping (and
the pages of the weights it replaced) can be released."""
import gc
import os
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
    ranges = file_pages.file_mappings()
    assert any(file_pages._in_mapping(p, ranges) for p in model.parameters())

    ffl_backend.quantize(model, "int8")
    ffl_backend.quantize(in_memory, "int8")
    gc.collect()
    assert not _mapped(weights)
    ranges = file_pages.file_mappings()
    assert not any(file_pages._in_mapping(t, ranges) for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor, now in memory
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, in_memory(ids).logits, rtol=0, atol=0)


def test_tensors_outside_mappings_and_skipped_modules_are_not_copied(saved_llama):
    model = AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.bfloat16).eval()
    norm = model.model.norm
    assert file_pages.copy_out_of_file_mappings(model, skip=(type(norm),)) > 0
    ranges = file_pages.file_mappings()
    assert file_pages._in_mapping(norm.weight, ranges)  # skipped module: still the file's
    before = [p.data_ptr() for p in model.parameters()]
    assert file_pages.copy_out_of_file_mappings(torch.nn.Linear(4, 4)) == 0
    assert [p.data_ptr() for p in model.parameters()] == before


def _mapping_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.fixture
def mapped_matrix(tmp_path):
    """(file, private copy-on-write mapping of a 512 x 1024 fp32 matrix as a tensor, its values)."""
    np = pytest.importorskip("numpy")
    values = torch.randn(512, 1024)
    path = tmp_path / "w.bin"
    values.numpy().tofile(path)
    with open(path, "rb") as fh:  # as a checkpoint is: written back, so its pages can be dropped
        os.fsync(fh.fileno())
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=(512, 1024)))
    return path, mapped, values


def test_page_out_drops_resident_pages_and_keeps_values(mapped_matrix):
    path, mapped, values = mapped_matrix
    assert torch.equal(mapped, values)  # reads every page
    resident = _mapping_rss_kib(path)
    assert resident >= 2048 - 8
    advised = file_pages.page_out(mapped)
    assert advised >= 2048 * 1024 - 8192
    assert _mapping_rss_kib(path) < resident / 4
    assert torch.equal(mapped, values)  # read back from the file


def test_page_out_keeps_pages_written_since_mapping(mapped_matrix):
    _, mapped, values = mapped_matrix
    mapped[100:110] = 7.0  # copy-on-write pages: only this process has them
    values[100:110] = 7.0
    file_pages.page_out(mapped)
    assert torch.equal(mapped, values)


def test_page_out_ignores_memory_not_in_a_file():
    t = torch.randn(512, 1024)
    assert file_pages.page_out(t) == 0
    assert file_pages.page_out(torch.randn(64, 64).t()) == 0  # not contiguous either


def test_copy_paging_out_copies_block_by_block(mapped_matrix, monkeypatch):
    path, mapped, values = mapped_matrix
    monkeypatch.setattr(file_pages, "COPY_BLOCK_BYTES", 100 * 4096)  # 100 rows of 4 KiB: 6 blocks
    copy = file_pages._copy_paging_out(mapped, file_pages.file_mappings())
    assert torch.equal(copy, values)
    assert not file_pages._in_mapping(copy, file_pages.file_mappings())
    assert _mapping_rss_kib(path) < 2048 / 4  # the source went back as it was copied


def test_quantize_pages_out_each_replaced_weight(saved_llama, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.bfloat16).eval()
    linears = {id(m.weight) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    paged, real_release = [], file_pages.release_pages
    monkeypatch.setattr("ffl_backend.quant.quantizer.release_pages",
                        lambda t, r=None: paged.append(id(t)) or real_release(t, r))
    ffl_backend.quantize(model, "int8")
    assert set(paged) == linears


def test_quantize_returns_the_free_heap_after_every_replaced_layer(saved_llama, monkeypatch):
    """glibc can keep a large layer's freed temporaries as RSS until trimmed; the trim must happen as
    quantize goes (a 1.7B model's peak grew by ~0.8 GB with one trim at the end), not only at its end."""
    model = AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.bfloat16).eval()
    events = []
    real_release = file_pages.release_pages
    monkeypatch.setattr("ffl_backend.quant.quantizer.release_pages",
                        lambda t, r=None: events.append("page_out") or real_release(t, r))
    monkeypatch.setattr("ffl_backend.quant.quantizer.release_free_heap", lambda: events.append("trim"))
    ffl_backend.quantize(model, "int8")
    layers = events.count("page_out")
    assert layers > 1 and events[:2 * layers] == ["page_out", "trim"] * layers
