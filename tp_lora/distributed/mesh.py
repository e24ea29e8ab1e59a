"""The rank lists of the process groups of a layout: pure functions of the world size and the parallel settings."""
from __future__ import annotations


def mesh_groups(world_size: int, tp_size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Rank lists of every tp group (consecutive ranks, so TP stays inside a node) and every dp group."""
    if world_size % tp_size:
        raise ValueError(f"world size {world_size} is not divisible by parallel.tp_size={tp_size}")
    dp_size = world_size // tp_size
    tp_groups = [tuple(range(d * tp_size, (d + 1) * tp_size)) for d in range(dp_size)]
    dp_groups = [tuple(range(t, world_size, tp_size)) for t in range(tp_size)]
    return tp_groups, dp_groups


def expert_mesh_groups(world_size: int, tp_size: int, ep_size: int, ep_attention: str) -> list[tuple[int, ...]]:
    """Rank lists of every expert-parallel group.

    ep_attention="dp": runs of ep_size consecutive members of each dp group (ranks with the same tp rank, different
    requests); the moe-tp group is then the tp group, so ep x tp is a 2D mesh. ep_attention="tp": the tp groups.
    """
    tp_groups, dp_groups = mesh_groups(world_size, tp_size)
    if ep_size == 1:
        return [(r,) for r in range(world_size)]
    if ep_attention == "tp":
        if ep_size != tp_size:
            raise ValueError(f"parallel.ep_attention=tp splits the experts over the attention TP group: "
                             f"parallel.ep_size={ep_size} must equal parallel.tp_size={tp_size}")
        return tp_groups
    if ep_attention != "dp":
        raise ValueError(f"parallel.ep_attention={ep_attention!r}: expected dp or tp")
    dp_size = world_size // tp_size
    if dp_size % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} must divide the {dp_size} data-parallel replicas "
                         f"({world_size} ranks / tp_size {tp_size}) when parallel.ep_attention=dp")
    return [g[i:i + ep_size] for g in dp_groups for i in range(0, dp_size, ep_size)]
