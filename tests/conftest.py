"""The shared fixtures: a clean environment, the tiny tokenizer, a saved tiny pair, and an app over a test
module's `pair`. The helpers behind them live in tests/support/.
"""

import os

import pytest
import torch
from _pytest.nodeid import NodeId

from tests.support.models import load_saved_pair, make_app, make_tokenizer, save_tiny_pair, specdec_env_cleared

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def clean_env():
    """Settings from config/default.toml and the test only, never from the caller's SPECDEC_* variables."""
    with specdec_env_cleared() as env:
        yield env


@pytest.fixture(scope="module")
def pair(tiny_pair_dirs):
    """The saved tiny pair, loaded once per test module (a module may override `pair` with its own)."""
    return load_saved_pair(tiny_pair_dirs)


@pytest.fixture(scope="module")
def app(pair):
    """The service over the test module's own `pair` fixture."""
    return make_app(pair)


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # pytest 9.2 reads a node's id from Node._id, while pytest-xdist 3.8 writes its `--dist loadgroup` tag
    # ("...@group") into Node._nodeid; copy it over so xdist_group marks keep a group on one worker
    for item in items:
        tagged = item.__dict__.get("_nodeid")
        if tagged and tagged != item.nodeid:
            item._id = NodeId.parse(tagged)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(draft_dir, target_dir): a saved tiny Llama pair sharing the character tokenizer."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))
