#!/usr/bin/env python
"""Read a ``POST /v1/completions`` body with vLLM's own request model (a thin wrapper).

stdin : the JSON body.
stdout: JSON object: the request's temperature, max_tokens, return_token_ids and stream as vLLM 0.32.0's
        ``CompletionRequest`` reads them, and ``greedy``: whether the sampling parameters it builds
        (``to_sampling_params``, no server defaults) are vLLM's greedy sampling type.
"""
import json
import sys

from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.sampling_params import SamplingType


def main() -> int:
    request = CompletionRequest.model_validate(json.load(sys.stdin))
    params = request.to_sampling_params(request.max_tokens or 16)
    print(json.dumps({"temperature": request.temperature, "max_tokens": request.max_tokens,
                      "return_token_ids": request.return_token_ids, "stream": request.stream,
                      "greedy": params.sampling_type == SamplingType.GREEDY}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
