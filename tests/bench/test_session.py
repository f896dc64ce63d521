"""bench/session.py: weight bytes, generates of exactly the tokens asked, left-padded batches."""


from ffl_backend.bench.grid import label
from tiny_models import tiny_model


def test_weight_bytes_counts_a_tied_table_once_and_skips_lookup_only_embeddings():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ffl_backend
    from ffl_backend.bench.session import weight_bytes
    from tiny_models import COMMON

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    untied = tiny_model("llama")  # the embedding is only looked up: not read per step
    emb = untied.get_input_embeddings().weight
    assert weight_bytes(untied) == nbytes(untied.parameters()) - nbytes([emb])
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON))
    assert weight_bytes(tied) == nbytes(tied.parameters())  # parameters() yields the tied table once
    before = weight_bytes(tied)
    ffl_backend.quantize(tied, "int8-all")  # one shared int8 table read by the head
    assert tied.get_input_embeddings().qweight.data_ptr() == tied.lm_head.qweight.data_ptr()
    unique = {t.data_ptr(): t for t in tied.state_dict().values()}
    assert weight_bytes(tied) == nbytes(unique.values()) < before / 3  # fp32 -> int8 + scales

def test_time_generate_makes_exactly_the_tokens_asked_even_past_eos():
    """The timed generate() must not stop at the end-of-sequence token (rates would count fewer steps
    than asked), and must get there without min_new_tokens' per-step logits processors."""
    import torch

    from ffl_backend.bench.session import time_generate

    model = tiny_model("llama")
    ids = torch.tensor([[1, 2, 3, 4]])
    first = time_generate(model, ids, 6)["tokens"]
    model.generation_config.eos_token_id = first[0]  # greedy decoding now emits EOS at once
    assert model.generate(ids, max_new_tokens=6, do_sample=False).shape[1] == ids.shape[1] + 1
    processors = []
    build = model._get_logits_processor
    model._get_logits_processor = lambda *a, **k: processors.append(build(*a, **k)) or processors[-1]
    run = time_generate(model, ids, 6)
    assert run["tokens"] == first and run["decode_tok_s"] > 0
    assert len(processors) == 1 and len(processors[0]) == 0

def test_left_padded_batches_hold_prompts_of_different_lengths():
    """--left-pad: row i of b keeps its last p - i p / (2 b) tokens, masked padding before them, and
    generate() gets the mask: row 0 (the whole prompt) decodes as it does alone."""
    import torch

    from ffl_backend.bench.session import batch_prompts, time_generate

    class Tok:
        pad_token_id, eos_token_id = None, 0

        def __call__(self, text, return_tensors):
            return type("Out", (), {"input_ids": torch.arange(1, 200)[None]})

    cfg = {"prompt_len": 16, "batch": 4, "left_pad": True}
    ids, mask = batch_prompts(Tok(), cfg)
    assert mask.sum(1).tolist() == [16, 14, 12, 10] and (ids[mask == 0] == 0).all()
    assert torch.equal(ids[1, 2:], ids[0, 2:]) and batch_prompts(Tok(), {**cfg, "left_pad": False})[1] is None
    assert label({**cfg, "model": "m", "backend": "eager", "dtype": "float32", "quant": "none"}).endswith(
        "b4 p16 left-padded")
    model = tiny_model("llama")
    run = time_generate(model, ids, 5, mask)
    assert run["rows_equal"] is None and run["tokens"] == time_generate(model, ids[:1], 5)["tokens"]


def test_a_quantized_model_is_saved_once_and_loaded_by_later_rounds(tiny_folder, tmp_path):
    """The alternating schedule's rounds (quantized_dir): the first quantizes and saves, a later one loads
    that model instead of quantizing, and both decode the same tokens."""
    import torch

    from ffl_backend.bench.session import load_model, time_generate

    cfg = {"model": str(tiny_folder), "dtype": "bfloat16", "quant": "int8", "quantized_dir": str(tmp_path / "q")}
    ids = torch.tensor([[3, 4, 5, 6]])
    first, _, _, quantize_s = load_model(cfg)
    assert quantize_s > 0 and (tmp_path / "q" / "ffl_quant.json").is_file() and not (tmp_path / "q.partial").exists()
    later, _, load_s, quantize_s = load_model(cfg)
    assert quantize_s == 0.0 and load_s > 0 and later is not first
    assert time_generate(later, ids, 4)["tokens"] == time_generate(first, ids, 4)["tokens"]
    plain = load_model({**cfg, "quant": "none", "quantized_dir": str(tmp_path / "p")})[0]
    assert not (tmp_path / "p").exists() and not hasattr(plain, "_ffl_quant")  # nothing to keep unquantized
