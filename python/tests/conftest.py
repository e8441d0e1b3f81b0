"""Shared fixtures: where the checkout and its build are, and a small Llama-architecture model with random
weights built from a config (no download): 2 layers, GQA (4 query heads over 2 kv heads), RoPE, head_dim 64."""
import os
import sys

import pytest

ROOT = os.environ.get("KVQ_SRCDIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("KVQ_BUILD") or os.path.join(ROOT, "build")
SPECS = os.path.join(ROOT, "specs")


def spec(name):
    return os.path.join(SPECS, name + ".kvq")


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def kvq_tool():
    path = os.path.join(BUILD, "kvq")
    if not os.access(path, os.X_OK):
        pytest.skip("%s is not built (make)" % path)
    return path


def tiny_llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                       rope_theta=10000.0, attn_implementation="sdpa")


@pytest.fixture(scope="session")
def tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    # Random init gives near-uniform attention; larger q/k weights make it peaked, as in trained models, so that
    # a scheme's quantization error shows in the logits.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.save_pretrained(d)
    return str(d)


def fresh_copy(model):
    """The same weights in a new model object (a KvqCache switches its model's attention implementation)."""
    import transformers
    m = transformers.LlamaForCausalLM(model.config).eval()
    m.load_state_dict(model.state_dict())
    m.set_attn_implementation("sdpa")
    return m


sys.path.insert(0, os.path.dirname(__file__))
