#!/usr/bin/env python
"""Parse a `vllm serve` argv with vLLM 0.32.0's own parser.

stdin : JSON list of strings = the arguments after `vllm serve`
        (starting with the model path), e.g. ["/models/m", "--port", "8000"].
stdout: JSON object = vars(args) after parse + ServeSubcommand.validate().

The parser is built exactly as vllm/entrypoints/cli/main.py does for `serve`:
top-level FlexibleArgumentParser -> add_subparsers(dest="subparser")
-> ServeSubcommand().subparser_init(subparsers).set_defaults(dispatch_function=...)
-> parse_args(["serve", *argv]) -> configure_logging_from_args -> cmd.validate(args).
(The other subcommands of main.py are not registered; they do not affect the
`serve` subparser.)  Argparse errors exit with code 2 and a message on stderr,
as with the real CLI; validate errors exit with code 1.
"""
import json
import os
import sys

# No GPU here: without this vLLM resolves to UnspecifiedPlatform and building
# the parser fails in DeviceConfig ("Failed to infer device type").
# The only parser-visible effect of the platform is the choice list of
# --mm-processor-device (CUDA adds "cuda"); see report.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> int:
    argv = json.load(sys.stdin)
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        print("stdin must be a JSON list of strings", file=sys.stderr)
        return 2

    # Keep stdout clean for JSON: anything vLLM prints/logs goes to stderr.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        import vllm.entrypoints.cli.serve as serve_mod
        from vllm.entrypoints.serve.utils.api_utils import (
            VLLM_SUBCMD_PARSER_EPILOG,
            cli_env_setup,
        )
        from vllm.logger import configure_logging_from_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        cli_env_setup()  # as main.py does (only sets VLLM_WORKER_MULTIPROC_METHOD)

        parser = FlexibleArgumentParser(
            prog="vllm",
            description="vLLM CLI",
            epilog=VLLM_SUBCMD_PARSER_EPILOG.format(subcmd="[subcommand]"),
        )
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        cmds = {}
        for cmd in serve_mod.cmd_init():
            cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
            cmds[cmd.name] = cmd

        args = parser.parse_args(["serve", *argv])
        cmd = cmds[args.subparser]
        configure_logging_from_args(args)
        try:
            cmd.validate(args)
        except Exception as e:  # same checks `vllm serve` runs before startup
            print(f"validate failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    finally:
        sys.stdout = real_stdout

    ns = vars(args)
    ns.pop("dispatch_function", None)  # bound method, not useful
    json.dump(ns, sys.stdout, default=str, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
