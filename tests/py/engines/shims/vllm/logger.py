"""Stand-in for vllm.logger (the real one configures vLLM's logging from vllm.envs): a standard
logger with vLLM's `*_once` helpers, which log each distinct message once."""

import logging


class _Logger(logging.Logger):
    _seen: set = set()

    def _once(self, level, msg, *args, **kwargs):
        kwargs.pop("scope", None)
        key = (level, msg, args)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)


def init_logger(name: str) -> logging.Logger:
    manager = logging.Logger.manager
    previous = manager.loggerClass
    manager.loggerClass = _Logger
    try:
        return logging.getLogger(name)
    finally:
        manager.loggerClass = previous
