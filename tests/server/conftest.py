"""The server tests' shared pieces: a TP_LORA_HOME of their own and the offline job's answers, once per session."""
import pytest

from _server import offline_reference


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_lora_home")


@pytest.fixture(scope="session")
def reference(home, tmp_path_factory):
    return offline_reference(home, tmp_path_factory.mktemp("offline") / "out.jsonl")
