"""Stand-in for vllm.logger (the real one configures vLLM's logging from vllm.envs)."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
