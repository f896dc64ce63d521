"""Plain ONNX Runtime over an exported folder: one step, greedy generation and full-sequence logits
(for perplexity), with the KV cache handed from each step's outputs to the next step's inputs."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from . import decoder

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class OnnxCausalLM:
    """An exported decoder in an `onnxruntime.InferenceSession` (CPU unless `providers` says)."""

    def __init__(self, folder, providers=None, threads: int | None = None, model_file: str = "model.onnx"):
        import onnxruntime as ort
        from transformers import AutoConfig

        self.folder = Path(folder)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(self.folder / model_file), options,
                                            providers=providers or ["CPUExecutionProvider"])
        self.config = AutoConfig.from_pretrained(self.folder)
        self.layers, self.kv_heads, self.head_dim = decoder.cache_geometry(self.config)
        kinds = {i.name: i.type for i in self.session.get_inputs()}
        self.kv_dtype = _NUMPY[kinds["past_key_values.0.key"]]
        self.inputs = decoder.input_names(self.layers)
        self.outputs = decoder.output_names(self.layers)

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), self.kv_dtype) for _ in range(2 * self.layers)]

    def step(self, ids, past=None, attention_mask=None):
        """One forward: ids (batch, seq) after `past` (None: empty). Returns (logits numpy, present)."""
        ids = np.ascontiguousarray(_numpy(ids), dtype=np.int64)
        batch, seq = ids.shape
        past = self.empty_past(batch) if past is None else past
        done = past[0].shape[2]
        mask = np.ones((batch, done + seq), np.int64) if attention_mask is None else _numpy(attention_mask)
        positions = np.broadcast_to(np.arange(done, done + seq, dtype=np.int64), (batch, seq))
        if attention_mask is not None:  # left padding: positions count only the real tokens
            positions = np.clip(np.cumsum(mask, axis=1)[:, done:] - 1, 0, None)
        feeds = dict(zip(self.inputs, [ids, mask, np.ascontiguousarray(positions), *past]))
        logits, *present = self.session.run(self.outputs, feeds)
        return logits, present

    def generate(self, input_ids, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
        """Greedy continuation of one prompt (1, L): the prompt and new tokens, as generate() returns."""
        ids = _numpy(input_ids).reshape(1, -1)
        stop = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
        out = [ids]
        logits, past = self.step(ids)
        for _ in range(max_new_tokens):
            token = logits[:, -1].argmax(-1).reshape(1, 1)
            out.append(token)
            if int(token[0, 0]) in stop or len(out) > max_new_tokens:
                break
            logits, past = self.step(token, past)
        return torch.from_numpy(np.concatenate(out, axis=1))

    def logits(self, input_ids) -> torch.Tensor:
        """Logits of every position of (batch, L) ids, as a float32 tensor."""
        return torch.from_numpy(self.step(input_ids)[0]).float()

    def __call__(self, input_ids, **_):
        """model(ids).logits as perplexity loops call it."""
        return SimpleNamespace(logits=self.logits(input_ids))


def genai_greedy(folder, input_ids, max_new_tokens: int) -> list[int]:
    """Prompt + greedy tokens from ONNX Runtime GenAI's own loop on an exported folder (its sequence
    stops before an EOS token, where OnnxCausalLM.generate keeps it)."""
    import onnxruntime_genai as og

    ids = _numpy(input_ids).reshape(1, -1)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=ids.shape[1] + max_new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(ids.astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


def _numpy(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

