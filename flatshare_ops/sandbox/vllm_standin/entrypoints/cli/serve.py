"""Stand-in for ``vllm.entrypoints.cli.serve``: the ``serve`` subcommand."""


class ServeSubcommand:
    """``vllm serve``: its subparser, and the checks vLLM runs after parsing (none in the stand-in)."""

    name = "serve"

    @staticmethod
    def cmd(args) -> None:
        """The stand-in engine is ``bin/vllm`` itself; this is never called by the preflight."""

    def subparser_init(self, subparsers):
        return subparsers.add_parser("serve", help="Start the vLLM OpenAI compatible API server.")

    def validate(self, args) -> None:
        """vLLM's post-parse checks are not mirrored (vllm_argv's docstring says which)."""


def cmd_init() -> list:
    """The subcommands this module registers."""
    return [ServeSubcommand()]
