"""The serving tests' model: a tiny Llama and the adapters of _serving.ADAPTERS, written once per session."""
import pytest

from _serving import ADAPTERS, write_random_adapter, write_tiny_llama


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    model = str(root / "model")
    write_tiny_llama(model, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, seed=11, max_position_embeddings=256)
    adapters = root / "adapters"
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        write_random_adapter(adapters / name, model, seed=100 + i, **kw)
    return model, str(adapters)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core runner: one intra-op thread is an order of magnitude faster than several."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
