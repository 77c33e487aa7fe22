"""Stand-in for ``vllm.renderers``: ``renderer_from_config`` reads the tokenizer's JSON files as
transformers does (a file that is not JSON is a ``json.JSONDecodeError``); a stand-in model may have none."""

import json
import os


def renderer_from_config(config, **kwargs):
    """The tokenizer directory's JSON files, parsed (the renderer itself is not needed here)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(config.model_config.tokenizer, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                json.load(f)
    return None
