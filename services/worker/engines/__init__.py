"""Inference engines a worker can drive: ``sim`` (calibrated model of vLLM, pure code, the
default without a GPU), ``vllm`` (in-process AsyncLLM) and ``openai`` (an external
OpenAI-compatible server). The worker app and the discrete-event simulator are the callers.
"""
