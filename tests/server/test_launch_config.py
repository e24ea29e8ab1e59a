"""The layout a launch without torchrun starts (parallel.dp_size x tp_size, every configs/parallel file), and the
refusals said before any collective: dp_size against the ranks torchrun launched, an unknown routing policy,
expert parallelism over a dense model."""
import os

import pytest
from omegaconf import OmegaConf

from tp_lora.api import check_expert_layout, make_config
from tp_lora.config import ConfigError, ParallelConfig, validate, world_size_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLDS = {"tp1": 1, "tp2": 2, "tp4": 4, "tp8": 8, "dp2": 2, "dp2_tp2": 4, "ep2": 2, "ep4": 4, "ep2_tp2": 4,
          "ep4_tp2": 8, "tp2_ep2": 2, "tp4_ep4": 4}


@pytest.mark.parametrize("layout", sorted(WORLDS))
def test_every_layout_file_names_its_world_size(layout):
    raw = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "configs", "parallel", f"{layout}.yaml")))
    p = ParallelConfig(**raw)
    assert world_size_of(p) == WORLDS[layout]
    validate(make_config({"parallel": raw}), WORLDS[layout])  # and torchrun launching that many is valid


def test_dp_size_against_the_launched_ranks_and_routing_are_checked():
    with pytest.raises(ConfigError, match=r"parallel.dp_size=2 x parallel.tp_size=2 = 4 ranks, but 2 were launched"):
        validate(make_config({"parallel.dp_size": 2, "parallel.tp_size": 2}), 2)
    with pytest.raises(ConfigError, match="server.routing='sticky': expected affinity, least_loaded or round_robin"):
        validate(make_config({"server.routing": "sticky"}))
    with pytest.raises(ConfigError, match="server.max_imbalance=-1"):
        validate(make_config({"server.max_imbalance": -1}))


def test_expert_parallelism_over_a_dense_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="parallel.ep_size=2 .* model_type='llama', not an MoE model"):
        check_expert_layout(make_config({"parallel.ep_size": 2}), str(tmp_path))
