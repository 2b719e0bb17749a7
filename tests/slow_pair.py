"""A loader for the gunicorn tests (SPECDEC_LOADER=slow_pair:load): the configured pair, loaded by load_pair,
with the target slowed by a few milliseconds per forward so a request is reliably still decoding when a test
overloads the server, disconnects or sends SIGTERM."""

import os
import time

from specdec import load_pair

DELAY = float(os.environ.get("SLOW_PAIR_DELAY", "0.005"))  # seconds per target forward


def load(settings):
    draft, target, tokenizer = load_pair(draft=settings.draft_model, target=settings.target_model,
                                         device=settings.device, dtype=settings.dtype)
    target.register_forward_hook(lambda module, args, output: time.sleep(DELAY))
    return draft, target, tokenizer
