"""The model code each fused op stands for, written out as Hugging Face's models write it (not the
ops' references), with model-shaped inputs: a float64 run is the exact answer, a bf16 run plain
PyTorch's own error. The op tests (tests/kernels) and the pattern-family tests (tests/patterns) both
compare against these."""
import math

import torch
import torch.nn.functional as F

from tests.helpers import acc_dtype


def llama_rms(x, w, eps):
    """LlamaRMSNorm.forward written out here (not the op's reference), in torch's opmath type: a
    float64 run of it is the exact answer, a bf16 run is plain PyTorch's own error."""
    h = x.to(acc_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def gemma_rms(x, w, eps):
    """GemmaRMSNorm.forward: the `1 + w` weight applied in fp32, one rounding at the end."""
    h = x.to(acc_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.to(acc_dtype(x)))).to(x.dtype)


def add_llama_rms(x, res, w, eps):
    h = res + x
    return llama_rms(h, w, eps), h


def rms_norm_inputs(dtype, n=576):
    return (torch.randn(4, 3, n, dtype=dtype) * 3, torch.nn.Parameter(torch.randn(n, dtype=dtype)),
            torch.randn(4, 3, n, dtype=dtype))


def layer_norm_hf(x, w, b, eps):
    """nn.LayerNorm as GPT-2 / GPT-NeoX call it; F.layer_norm on float64 inputs is the exact answer."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


def layer_norm_inputs(dtype):
    x = (torch.randn(4, 3, 576) * 3 + 2).to(dtype)  # nonzero row mean, so centring matters
    return x, torch.nn.Parameter(torch.randn(576, dtype=dtype)), torch.nn.Parameter(torch.randn(576, dtype=dtype))


def swiglu(gate, up):
    """LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)`, written here (not the op's reference): a
    float64 run is the exact answer, a bf16 run plain PyTorch's own error."""
    return F.silu(gate) * up


def geglu(gate, up, approximate):
    return F.gelu(gate, approximate=approximate) * up


def gate_up_halves(dtype, width=96):
    """Phi-3's fused gate_up_proj output and its two halves (strided views)."""
    gu = torch.randn(4, 3, 2 * width, dtype=dtype) * 3
    return gu, gu[..., :width], gu[..., width:]


def gelu_mlp(x, b, r, approximate):
    """GPT-2 / GPT-NeoX MLP activation as HF runs it: `act(c_fc(x)) + residual`, where c_fc's bias
    add comes first (written here, not the op's reference; float64 in = the exact answer)."""
    return torch.nn.functional.gelu(x + b, approximate=approximate) + r


def new_gelu(x, r):
    """GPT-2's NewGELUActivation, op by op, then the residual add."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))) + r


def gelu_residual_inputs(dtype):
    return torch.randn(4, 3, 576, dtype=dtype) * 3, torch.randn(576, dtype=dtype), torch.randn(4, 3, 576, dtype=dtype)


def rope_cos_sin(batch, seq_len, rotary_dim, dtype, base=10000.0):
    """What HF's rotary embedding returns: cat(freqs, freqs), cos/sin in the model dtype."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    pos = torch.arange(seq_len, dtype=torch.float32) + torch.randint(0, 100, (batch, 1))
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def attention_qk(batch, n_q, n_k, seq_len, head_dim, dtype):
    """q and k as attention makes them: `proj(x).view(B, L, H, D).transpose(1, 2)`, non-contiguous."""
    q = torch.randn(batch, seq_len, n_q * head_dim, dtype=dtype).view(batch, seq_len, n_q, head_dim)
    k = torch.randn(batch, seq_len, n_k * head_dim, dtype=dtype).view(batch, seq_len, n_k, head_dim)
    return q.transpose(1, 2), k.transpose(1, 2)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def hf_rotary(q, k, cos, sin, rotary_dim):
    """HF's apply_rotary_pos_emb with partial rotary (Phi-3 / GPT-NeoX), written here (not the op's
    reference): float64 inputs give the exact answer, bf16 ones plain PyTorch's own error."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x in (q, k):
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        out.append(torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1))
    return tuple(out)
