"""Stand-in for ``vllm.logger``: what the preflight script calls."""

import logging


def init_logger(name: str) -> logging.Logger:
    """vLLM's logger factory."""
    return logging.getLogger(name)


def configure_logging_from_args(args) -> None:
    """vLLM configures its logging from the parsed args; the stand-in has nothing to configure."""
