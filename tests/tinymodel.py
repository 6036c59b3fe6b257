"""A tiny Llama (random float32 weights) and a word-level tokenizer, built locally.

Nothing is downloaded: the tokenizer is a ``tokenizers`` WordLevel model over a generated
vocabulary, wrapped in ``PreTrainedTokenizerFast``; the weights are a seeded random init of
``LlamaForCausalLM``. ``python tests/tinymodel.py DIR`` writes one (the vLLM PD example uses it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def _words(n: int) -> list[str]:
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out = []
    for i in range(n):
        w, k = "", i
        for _ in range(3):
            w += consonants[k % len(consonants)] + vowels[(k // len(consonants)) % len(vowels)]
            k //= len(consonants) * len(vowels)
        out.append(w)
    return out


def build_tiny_llama(out: str | Path, *, vocab_words: int = 1020, hidden: int = 256,
                     layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer into ``out``; returns the path."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tf: Any = transformers  # untyped constructors, called dynamically

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + _words(vocab_words))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = tf.LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # a wider init than the default, so greedy outputs vary by prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    conf = json.loads((out / "config.json").read_text())
    conf["torch_dtype"] = conf["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(conf, indent=1))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tinymodel.py OUT_DIR")
    print(build_tiny_llama(sys.argv[1]))
