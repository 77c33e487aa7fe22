"""Stand-in for ``vllm.engine.arg_utils``: what the preflight (vllm_serve_parse.py preflight) runs after parsing.

``AsyncEngineArgs.from_cli_args(args).create_engine_config()`` checks, as vLLM's does without the
device, the two things a stand-in model can say: ``--max-model-len`` above the model's
``max_position_embeddings`` (its config.json) and a speculative draft model path that does not
exist, with vLLM's own wording; ``scheduler_config.get_scheduler_cls()`` imports ``--scheduler-cls``
as vLLM's ``resolve_obj_by_qualname`` does; ``model_config.tokenizer`` is the model's directory, for the
preflight's tokenizer stage (``vllm_standin/renderers``).
"""

import importlib
import json
import os


class _SchedulerConfig:
    def __init__(self, scheduler_cls):
        self.scheduler_cls = scheduler_cls

    def get_scheduler_cls(self):
        """The class ``--scheduler-cls`` names, imported (ModuleNotFoundError, AttributeError)."""
        module, _, name = str(self.scheduler_cls).rpartition(".")
        return getattr(importlib.import_module(module), name)


class _ModelConfig:
    def __init__(self, model):
        self.model = model
        self.tokenizer = model

    def get_diff_sampling_param(self):
        return {}


class _VllmConfig:
    def __init__(self, scheduler_cls, model):
        self.scheduler_config = _SchedulerConfig(scheduler_cls)
        self.model_config = _ModelConfig(model)


class AsyncEngineArgs:
    """The parsed arguments, as vLLM's engine arguments."""

    def __init__(self, args):
        self.args = args

    @classmethod
    def from_cli_args(cls, args):
        return cls(args)

    def create_engine_config(self, usage_context=None):
        a = vars(self.args)
        model = a.get("model") or a.get("model_tag") or ""
        try:
            with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
                positions = json.load(f).get("max_position_embeddings")
        except (OSError, ValueError):
            positions = None
        wanted = a.get("max_model_len")
        if isinstance(positions, int) and isinstance(wanted, int) and wanted > positions:
            raise ValueError(f"User-specified max_model_len ({wanted}) is greater than the derived max_model_len "
                             f"(max_position_embeddings={positions} in model's config.json)")
        speculative = a.get("speculative_config")
        draft = speculative.get("model") if isinstance(speculative, dict) else None
        if isinstance(draft, str) and draft.startswith("/") and not os.path.exists(draft):
            raise ValueError(f"Invalid repository ID or local directory specified: '{draft}'")
        return _VllmConfig(a.get("scheduler_cls"), model)
