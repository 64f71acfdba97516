"""Test fixtures. The settings (8 simulated CPU devices, strict numerics) are in ../conftest.py."""

import jax
import pytest


@pytest.fixture(scope="session")
def strategy8():
    import xlafit

    strategy = xlafit.connect()
    assert strategy.num_replicas == 8, "tests need 8 simulated devices"
    return strategy


@pytest.fixture(scope="session")
def strategy1(strategy8):
    import numpy as np
    from jax.sharding import Mesh

    from xlafit.devices import Strategy

    return Strategy(Mesh(np.array(jax.devices()[:1]), ("data",)))


@pytest.fixture(scope="session")
def korean_tokenizer(tmp_path_factory):
    """A 2000-token WordPiece tokenizer trained on the Korean demo texts, once per session."""
    from xlafit.data.text import korean_demo_files
    from xlafit.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(korean_demo_files(), 2000, out, show_progress=False)
    return out
