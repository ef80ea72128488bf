"""Messages of the plugin's logger, kept by a handler attached to it.

vLLM's ``vllm`` logger does not propagate to the root logger that pytest's ``caplog`` listens on,
and vLLM's logging set-up drops handlers of the loggers below the ones it names: tests attach a
handler to ``vllm.vllm_mtp_plugin`` (every plugin module's logger) themselves.
"""

import contextlib
import logging

PLUGIN_LOGGER = "vllm.vllm_mtp_plugin"


class MessageHandler(logging.Handler):
    """Keeps ``record.getMessage()`` of every record at its level or above, in ``messages``."""

    def __init__(self, level: int = logging.NOTSET):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def plugin_log(level: int = logging.WARNING, logger: str | logging.Logger = PLUGIN_LOGGER):
    """The messages at ``level`` or above that ``logger`` logs inside the block (a list, filled
    as they come). The logger's own level is lowered to ``level`` meanwhile, then restored."""
    log = logging.getLogger(logger) if isinstance(logger, str) else logger
    handler, previous = MessageHandler(level), log.level
    log.addHandler(handler)
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)
