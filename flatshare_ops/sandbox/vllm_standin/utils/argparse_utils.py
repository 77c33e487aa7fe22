"""Stand-in for ``vllm.utils.argparse_utils``: a ``FlexibleArgumentParser`` whose ``serve`` reads
a command line as the venv's vLLM release does (the option table dumped from its real parser)."""

import argparse
import importlib.metadata
import logging

from flatshare_ops.common import vllm_argv


class FlexibleArgumentParser(argparse.ArgumentParser):
    """``vllm serve ...`` parsed by :func:`vllm_argv.read_argv` for this venv's release."""

    def parse_args(self, args=None, namespace=None):
        if args and args[0] == "serve":
            release = importlib.metadata.version("vllm")
            reading = vllm_argv.read_argv(list(args), release)
            for warning in reading.warnings:
                logging.getLogger("vllm").warning(warning)
            if reading.errors:
                self.error(reading.errors[0])
            return argparse.Namespace(subparser="serve", model_tag=reading.model, **reading.values)
        return super().parse_args(args, namespace)
