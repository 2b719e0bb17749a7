"""The start-up log: one line per step of loading a pair, "start-up: <what> in <seconds> s (<detail>)"."""

import contextlib
import logging
import time

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def startup_step(what: str):
    """Time one step of a start-up and log it as one line. The step may set `note["detail"]` on the dict it is
    given, and `note["what"]` in place of `what` (a step that turned out otherwise)."""
    note: dict = {}
    started = time.perf_counter()
    yield note
    log_step(note.get("what", what), time.perf_counter() - started, note.get("detail"))


def log_step(what: str, seconds: float, detail: str | None = None) -> None:
    """One start-up step's line (see `startup_step`)."""
    logger.info("start-up: %s in %.2f s%s", what, seconds, f" ({detail})" if detail else "")
