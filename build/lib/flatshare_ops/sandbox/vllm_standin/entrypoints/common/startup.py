"""Stand-in for ``vllm.entrypoints.common.startup`` (where vLLM 0.33.0 moved its CLI startup bits)."""

VLLM_SUBCMD_PARSER_EPILOG = "For full list: vllm {subcmd} --help=all"


def cli_env_setup() -> None:
    """vLLM sets VLLM_WORKER_MULTIPROC_METHOD here; the stand-in needs nothing."""
