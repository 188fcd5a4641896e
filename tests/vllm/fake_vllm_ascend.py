"""Stands in for vllm-ascend's connector module: only its registration matters here."""


class AscendStoreConnector:  # the name vllm-ascend registers
    origin = "vllm-ascend"
