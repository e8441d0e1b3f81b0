"""Post-RoPE queries, keys and values of a transformers model, as its attention receives them.

Post-RoPE because that is what a KV cache holds and what attention multiplies: a model's cache stores keys after
the rotary embedding, and the decode query is rotated too (docs/eval.md). Quantizing pre-RoPE keys is a different
scheme (KVQuant) that kvq does not model."""
import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CAPTURE_NAME = "kvq_capture"


def capture_qkv(model, input_ids):
    """Runs model on input_ids [1, T] with no cache and returns numpy float32 arrays in kvq eval's layout:
    K, V [layers, kv_heads, T, head_dim] and Q [layers, heads, T, head_dim], plus the logits [T, vocab]."""
    if input_ids.shape[0] != 1:
        raise ValueError("kvq: capture one sequence at a time (batch 1)")
    seen = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (key[0].detach().float().cpu().numpy(), value[0].detach().float().cpu().numpy(),
                                  query[0].detach().float().cpu().numpy())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_NAME, record)
    AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    layers = sorted(seen)
    K = np.stack([seen[i][0] for i in layers])
    V = np.stack([seen[i][1] for i in layers])
    Q = np.stack([seen[i][2] for i in layers])
    return K, V, Q, out.logits[0].float().cpu().numpy()
