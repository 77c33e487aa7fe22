"""Stand-in for ``vllm.entrypoints.serve.utils.api_utils`` (where vLLM 0.32.0 keeps its CLI startup bits)."""

VLLM_SUBCMD_PARSER_EPILOG = "For full list: vllm {subcmd} --help=all"


def cli_env_setup() -> None:
    """vLLM sets VLLM_WORKER_MULTIPROC_METHOD here; the stand-in needs nothing."""
