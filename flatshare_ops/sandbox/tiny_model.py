"""Write the sandbox's tiny model: a Llama with random weights and a word-level tokenizer, from nothing downloaded.

Run by the real engine venv's Python (it has torch, transformers and tokenizers), as a script:

    .venv-vllm/bin/python flatshare_ops/sandbox/tiny_model.py OUT_DIR

Writes OUT_DIR/config.json (``LlamaForCausalLM``: hidden 128, intermediate 256, 2 layers, 4 heads,
2 KV heads, head_dim 32, vocabulary 512, 2,048 positions, BF16), ``model.safetensors``
(``save_pretrained``, about 0.9 MB: vLLM loads it as it loads any model, so production's flags need no
``--load-format dummy``), ``tokenizer.json`` and its configs. The same seed gives the same bytes, so
every node gets the same model. Written into OUT_DIR.tmp, then renamed: a killed run leaves no
half a model.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

POSITIONS = 2048


def write(out: Path) -> None:
    """Write the model into ``out`` (replaced whole)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    scratch = out.with_name(out.name + ".tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(509)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(scratch)
    config = LlamaConfig(vocab_size=len(words), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=POSITIONS,
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(scratch, safe_serialization=True)
    for path in scratch.iterdir():  # safetensors writes 0600: the engine runs as the service user
        path.chmod(0o644)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(scratch, out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: tiny_model.py OUT_DIR", file=sys.stderr)
        sys.exit(2)
    write(Path(sys.argv[1]))
