"""Writes a transformers Llama as a GGUF file with the gguf package's writer, as llama.cpp's convert_hf_to_gguf.py
does for the "llama" architecture: its tensor names, Q and K rows permuted into llama.cpp's rotary layout (which
transformers' GGUF loader permutes back), float32 tensors (so the loaded model is the same model, to the bit),
and a byte-level BPE tokenizer ("gpt2" model) whose 256 tokens are the 256 bytes in order, so that token id =
byte value and a text tokenizes as its bytes."""
import numpy as np


def _bytes_to_unicode():
    """GPT-2's byte-to-character map (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _permute(w, n_head, n_head_kv=None):
    """llama.cpp's permute of Q/K rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path, name="kvq tiny llama"):
    import gguf
    cfg = model.config
    H, HKV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.vocab_size == 256:
        b2u = _bytes_to_unicode()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([b2u[b] for b in range(256)])
        w.add_token_types([gguf.TokenType.NORMAL] * 256)
        w.add_token_scores([0.0] * 256)
        w.add_token_merges([])
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        w.add_add_bos_token(False)
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names["model.layers.%d.%s.weight" % (i, hf)] = "blk.%d.%s.weight" % (i, gg)
    for key, x in sd.items():
        if key == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        if ".q_proj." in key:
            x = _permute(x, H, H)
        elif ".k_proj." in key:
            x = _permute(x, H, HKV)
        w.add_tensor(names[key], np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
