"""Test setup. Without a GPU, Triton kernels run in its interpreter, which must be switched on
before any @triton.jit function is defined (that is, before the kernels are imported)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def restore_logging_handlers():
    """Drop logging handlers a test added (`occult.cli.main` calls logging.basicConfig, transformers
    adds its own on first use): they hold the stderr capture of that one test, closed afterwards."""
    def handlers() -> dict[str, list]:
        loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
        return {logger.name: list(logger.handlers) for logger in loggers}

    before = handlers()
    yield
    for name, now in handlers().items():
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        for handler in now:
            if handler not in before.get(name, []):
                logger.removeHandler(handler)
