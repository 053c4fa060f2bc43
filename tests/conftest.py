import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: threads only add contention


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def small_vocab():
    """An 8-token model (tests/models.py ``small_prompts`` feeds it): random drafters get many drafts accepted."""
    from models import tiny_model

    import hf_paralleldecode as hfpd

    return hfpd.enable(tiny_model("qwen3", vocab_size=8))
