"""Layer-parallel groups across processes: EasySpec's multi-GPU fuzzy speculation.

Importing this module registers the ``distributed`` group executor in
:data:`runtime.layer_exec.GROUP_EXECUTORS`; select it with ``lm.group_executor = "distributed"``
once ``torch.distributed`` is initialised (:func:`init_from_env` under ``torchrun``).

Every rank holds the whole model and runs the same forward. For a layer-parallel group of ``N``
executed attention members, member ``i`` is assigned to rank ``i % world_size``; each rank computes
the attention of its members only (one batched call over their stacked weights) and writes only
their K/V into its local cache. The outputs are exchanged with one ``all_gather`` of a padded
``[ceil(N / world), T, H]`` buffer so that every rank has every member's output. Everything else
(embeddings, single layers, residual adds, MLPs, final norm, head) runs replicated, so all ranks
produce identical logits.

Cache invariant: for a group member's layer, the K/V rows a forward under the plan writes are
valid only on the rank that owns the member (other ranks keep whatever the slot held). Only that
rank ever reads them while the same plan is used; an exact forward (plan ``None``, e.g. EasySpec's
bonus calibration) rewrites the slots for every layer on every rank. Do not switch plans with
different group assignments over cache rows written under another plan without such a rewrite.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from runtime.errors import RuntimeUserError
from runtime.layer_exec import GROUP_EXECUTORS, AttnInputs, GroupWeights, batched_group

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``): gloo on CPU,
    NCCL when CUDA is available (each rank then uses ``cuda:LOCAL_RANK``). Returns
    ``(rank, world_size)``; a no-op when already initialised."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeUserError(
            f"torch.distributed environment variables {', '.join(missing)} are not set; "
            "launch with `torchrun --nproc-per-node N -m ...`"
        )
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_device())
    dist.init_process_group(backend=backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def member_rank(index: int, world_size: int) -> int:
    """The rank computing the attention of a group's ``index``-th executed member."""
    return index % world_size


def _shard(g: GroupWeights, rank: int, world: int) -> GroupWeights | None:
    """The members of ``g`` this rank computes, with their stacked weights (cached on ``g``)."""
    shards: dict[tuple[int, int], GroupWeights | None] = g.__dict__.setdefault("_rank_shards", {})
    key = (rank, world)
    if key not in shards:
        idx = [i for i in range(len(g.members)) if member_rank(i, world) == rank]
        if not idx:
            shards[key] = None
        elif len(idx) == len(g.members):
            shards[key] = g
        else:
            sel = torch.tensor(idx, device=g.w_qkv.device)

            def pick(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else x.index_select(0, sel).contiguous()

            shards[key] = GroupWeights(
                members=tuple(g.members[i] for i in idx), norm_w=pick(g.norm_w), eps=g.eps,
                w_qkv=pick(g.w_qkv), b_qkv=pick(g.b_qkv), w_o=pick(g.w_o), b_o=pick(g.b_o),
            )
    return shards[key]


def distributed_group(lm, g: GroupWeights, h1: torch.Tensor, a: AttnInputs) -> dict[int, torch.Tensor]:
    """Each rank: its members' attention on the group input, then all_gather of every output."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeUserError(
            "group executor 'distributed' needs torch.distributed initialised; run under torchrun and "
            "call runtime.distributed.init_from_env() first (or use group executor 'batched')"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    local = _shard(g, rank, world)
    if world == 1:
        assert local is not None
        return batched_group(lm, local, h1, a)
    n = len(g.members)
    per_rank = -(-n // world)
    send = h1.new_zeros(per_rank, *h1.shape)  # [ceil(N / world), T, H]
    if local is not None:
        out = batched_group(lm, local, h1, a)
        for j, li in enumerate(local.members):
            send[j] = out[li]
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send)
    # member i was computed by rank i % world as that rank's (i // world)-th member
    return {li: recv[member_rank(i, world)][i // world] for i, li in enumerate(g.members)}


GROUP_EXECUTORS["distributed"] = distributed_group
