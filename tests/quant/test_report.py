"""Per-layer report and perplexity on tiny models; the console scripts on SmolLM2 (slow)."""
import copy
import json
import math
import types
from pathlib import Path

import pytest
import torch

import ffl_backend
from ffl_backend.quant import report
from ffl_backend.quant.cli import perplexity
from ffl_backend.quant.layer_report import format_table
from tests.tiny_models import tiny_model

AUSTEN = Path(__file__).parents[1] / "data" / "austen_slice.txt"


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _calib():
    return [torch.randint(3, 128, (1, 24)) for _ in range(2)]


def test_report_sorted_worst_first_with_skip_list(llama):
    before = copy.deepcopy(llama.state_dict())
    rep = report(llama, ffl_backend.QuantConfig("int4", group_size=32), _calib(), target_sqnr=19.0)
    sqnrs = [r["output_sqnr_db"] for r in rep["layers"]]
    assert len(sqnrs) == 14 and sqnrs == sorted(sqnrs)
    assert rep["skip_for_target"] == [r["name"] for r in rep["layers"] if r["output_sqnr_db"] < 19.0]
    assert all(15.0 < r["weight_sqnr_db"] < 30.0 for r in rep["layers"])
    json.dumps(rep)
    assert "output dB" in format_table(rep)
    assert all(torch.equal(v, llama.state_dict()[k]) for k, v in before.items())  # model untouched


def test_report_lists_layers_the_scheme_cannot_take(llama):
    rep = report(llama, ffl_backend.QuantConfig("int4", group_size=64), _calib())
    assert set(rep["kept"]) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert "kept in high precision" in format_table(rep)


def test_report_int8_is_better_than_int4(llama):
    worst = {s: report(llama, s, _calib())["layers"][0]["output_sqnr_db"] for s in ("int8", "w8a8", "fp8")}
    assert worst["int8"] > 38.0 and worst["w8a8"] > 30.0 and worst["fp8"] > 24.0


def test_perplexity_is_exp_of_the_model_loss(llama):
    ids = torch.randint(3, 128, (40,))
    with torch.no_grad():
        loss = llama(ids[None], labels=ids[None]).loss
    assert perplexity(llama, ids, window=64) == pytest.approx(loss.exp().item(), rel=1e-4)
    windows = perplexity(llama, ids, window=16)  # 3 windows, 37 predictions
    assert 1.0 < windows < 1e4


def test_perplexity_with_bos_starts_every_window_with_it(llama):
    """With a BOS id, each window is BOS + window - 1 text tokens, every text token predicted once."""
    ids = torch.randint(3, 128, (30,))
    bos = 1
    nll = []
    with torch.no_grad():
        for start in range(0, 30, 15):
            chunk = torch.cat([torch.tensor([bos]), ids[start:start + 15]])[None]
            nll.append(llama(chunk, labels=chunk).loss * 15)
    expected = math.exp(sum(nll).item() / 30)
    assert perplexity(llama, ids, window=16, bos=bos) == pytest.approx(expected, rel=1e-4)


def test_text_tokens_drop_a_leading_bos_and_report_it(tmp_path):
    from ffl_backend.quant.cli import _calibration, _tokens

    class Tokenizer:
        def __init__(self, bos):
            self.bos_token_id = bos

        def __call__(self, text, return_tensors):
            body = [ord(c) for c in text]
            return types.SimpleNamespace(input_ids=torch.tensor([([self.bos_token_id] if self.bos_token_id else [])
                                                                 + body]))

    path = tmp_path / "t.txt"
    path.write_text("abcdefg")
    ids, bos = _tokens(Tokenizer(7), str(path))
    assert bos == 7 and ids.tolist() == [ord(c) for c in "abcdefg"]
    assert _tokens(Tokenizer(None), str(path))[1] is None
    windows = _calibration(ids, 0, 7, window=4, bos=bos)
    assert [w.tolist() for w in windows] == [[[7, 97, 98, 99]], [[7, 100, 101, 102]], [[7, 103]]]


@pytest.mark.slow
def test_console_scripts_on_smollm2(tmp_path, capsys):
    from ffl_backend.quant.cli import eval_ppl_main, quant_report_main

    out = tmp_path / "ppl.json"
    assert eval_ppl_main(["--text", str(AUSTEN), "--max-tokens", "1024", "--schemes", "int8",
                          "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert abs(res[1]["delta_pct"]) < 1.0
    assert quant_report_main(["--text", str(AUSTEN), "--scheme", "int4-g128", "--calib-tokens", "256",
                              "--limit", "5", "--json", str(tmp_path / "rep.json")]) == 0
    assert "output dB" in capsys.readouterr().out
