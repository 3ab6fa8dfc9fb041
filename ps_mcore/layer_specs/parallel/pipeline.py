"""Every rank of a model-parallel group must run the same plan: a cheap check.

Under pipeline (and tensor / context) parallelism each rank plans the micro-batch itself from
the same tokens, so no plan is ever sent; a rank that planned differently (other tokens, other
planner options) would silently compute garbage. :func:`assert_same_plan` compares a 63-bit
fingerprint of the plan with one all-reduce. Only the last pipeline stage unpacks outputs.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ps_mcore.planner import TreePlan

_FINGERPRINT_FIELDS = (
    "input_ids", "position_ids", "unpack_index", "cu_seqlens_q", "cu_seqlens_kv", "kv_index",
)


def plan_fingerprint(plan: TreePlan) -> int:
    """A 63-bit hash of the plan's layout (tokens, positions, node and context boundaries,
    ``kv_index``, ``unpack_index``, sequence lengths); equal plans give equal fingerprints on
    any device. Kept on the plan's host copy (``plan.host.memo``)."""
    if not isinstance(plan, TreePlan):
        raise TypeError(f"plan_fingerprint expects a TreePlan, got {type(plan).__name__}")
    host = plan.host  # no device-to-host sync for a moved plan
    if host.memo.fingerprint is None:
        h = hashlib.blake2b(digest_size=8)
        h.update(np.asarray(host.seq_lens, dtype=np.int64).tobytes())
        for name in _FINGERPRINT_FIELDS:
            values = getattr(host, name).detach().cpu().numpy().astype(np.int64)
            h.update(np.int64(values.size).tobytes())
            h.update(values.tobytes())
        host.memo.fingerprint = int.from_bytes(h.digest(), "little") >> 1  # fits a signed int64
    return host.memo.fingerprint


def _collective_device(group, plan: TreePlan) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    if plan.device.type != "cpu":
        return plan.device
    return torch.device("cuda", torch.cuda.current_device())


def _combined_fingerprint(plans: Sequence[TreePlan]) -> int:
    if len(plans) == 1:
        return plan_fingerprint(plans[0])
    h = hashlib.blake2b(digest_size=8)
    for plan in plans:
        h.update(plan_fingerprint(plan).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


def assert_same_plan(plans: TreePlan | Sequence[TreePlan], group=None) -> int:
    """Raise unless every rank of ``group`` holds the same plan(s): one all-reduce.

    Args:
        plans: this rank's plan, or the plans of all its micro-batches (checked at once).
        group: e.g. Megatron's pipeline-parallel group (``parallel_state.
            get_pipeline_model_parallel_group()``), or its model-parallel / CP group; None: the
            default (world) group. Collective: every rank of the group calls it, so call it
            before the pipeline schedule, not inside ``forward_step`` (stages run a
            micro-batch's forward at different times: a collective there deadlocks).

    Returns:
        The (combined) fingerprint.
    """
    plans = [plans] if isinstance(plans, TreePlan) else list(plans)
    if not plans or not all(isinstance(p, TreePlan) for p in plans):
        raise TypeError("assert_same_plan expects a TreePlan or a non-empty sequence of TreePlans")
    fp = _combined_fingerprint(plans)
    if group is not None and dist.get_world_size(group) == 1:
        return fp
    # max of (fp, -fp) over the group gives (max fp, -min fp): all equal iff both equal fp.
    both = torch.tensor([fp, -fp], dtype=torch.int64, device=_collective_device(group, plans[0]))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(both[0]), -int(both[1])
    if hi != fp or lo != fp:
        raise RuntimeError(
            f"ranks of the group hold different plans (fingerprints between {lo:#x} and {hi:#x}, "
            f"this rank {fp:#x}, {len(plans)} micro-batch(es), T={[p.num_tokens for p in plans]}): "
            "every pipeline stage / model-parallel rank must plan the same tokens with the same "
            "planner options"
        )
    return fp
