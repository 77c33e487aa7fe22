"""Stand-in for ``vllm.usage.usage_lib``: the usage context the preflight names."""

import enum


class UsageContext(str, enum.Enum):
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
