"""Stand-in for the ``vllm`` Python package, installed into a sandbox node's engine venv.

It provides exactly the modules flatshare-ops' preflight script
(``flatshare_ops/common/vllm_serve_parse.py``) imports from vLLM, laid out as
the venv's vLLM release lays them out (0.33.0 moved its startup module), so
that the preflight runs unchanged in the sandbox. Its ``serve`` parser reads
a command line with the option table dumped from that release's real parser
(``flatshare_ops.common.vllm_argv``), so it rejects what vLLM rejects, with
vLLM's messages. The sandbox's stand-in engine (``bin/vllm``) uses the same.
"""
