"""The server tests' shared pieces: a TP_LORA_HOME of their own, the embedded default in it, and the offline job's
answers, once per session."""
import os

import pytest

from _server import offline_reference
from tp_lora.assets import ensure_default_assets


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_lora_home")


@pytest.fixture(scope="session")
def reference(home, tmp_path_factory):
    return offline_reference(home, tmp_path_factory.mktemp("offline") / "out.jsonl")


@pytest.fixture(scope="session")
def default(home):
    """The embedded default's paths (model, adapters, requests), written under `home`."""
    os.environ["TP_LORA_HOME"], old = str(home), os.environ.get("TP_LORA_HOME")
    try:
        return ensure_default_assets()
    finally:
        os.environ.pop("TP_LORA_HOME") if old is None else os.environ.update(TP_LORA_HOME=old)
