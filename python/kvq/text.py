"""Loading a causal LM and turning a text file into token ids, for kvq-dump and kvq-ppl."""
import torch


def load_model(path, dtype="float32"):
    from transformers import AutoModelForCausalLM
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa").eval()


def tokenize(path_or_model, text_file, byte_tokens=False, max_tokens=None):
    """ids [1, T]: the model folder's tokenizer, or with byte_tokens the file's UTF-8 bytes as ids (for models
    without a tokenizer, e.g. a test model whose vocabulary holds 256 ids)."""
    with open(text_file, "rb") as f:
        data = f.read()
    if byte_tokens:
        ids = list(data)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path_or_model)
        ids = tok(data.decode("utf-8", errors="replace"))["input_ids"]
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise SystemExit("kvq: %s holds fewer than 2 tokens" % text_file)
    return torch.tensor([ids], dtype=torch.long)
