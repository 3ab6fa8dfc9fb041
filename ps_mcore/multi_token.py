"""Multi-token prediction (MTP) on a prefix tree: the rows of each prediction depth.

MTP depth k (DeepSeek-V3; megatron-core's ``MultiTokenPredictionBlock``) gives position i of
a sequence the input ``[embedding(x[i+k]), h^{k-1}[i]]`` (``h^0``: the decoder's output), runs
one transformer layer causally over the positions and predicts ``x[i+k+1]``. The depth-k row
at position i therefore depends on the tokens ``x[0..i+k]``: on a tree it is identified by the
packed row of token ``i+k``. A row shared by several samples at depth 0 stays shared at depth
k only as far as the k tokens after it agree; at a branch point each continuation gets its
own row, which this layout gets for free by naming each depth-k row after that packed row:

* the depth-k rows are the packed rows at positions >= k, laid out as a prefix forest of their
  own (:attr:`DepthPlan.plan`, planned over each sample's row ids from position k; its
  position ids are ``position - k``, what RoPE sees at depth k);
* the depth-k row of packed row r reads ``h^{k-1}`` of the row before r on its path
  (:attr:`DepthPlan.source`) and the embedding of r's own token;
* each original token (sample s, position i) with ``i + k + 1 < len(s)`` reads the depth-k
  row of ``(s, i)`` and is labelled ``x[i+k+1]`` (:attr:`DepthPlan.tokens`), so a shared row
  is scored once per distinct continuation and every sample behind it counts.

The last k positions of a sequence (whose rolled input is past its end) are left out: stock
MTP computes them, masks their loss to 0, and nothing else reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ps_mcore.logprobs import LocalTokenRows
from ps_mcore.planner import TreePlan, plan_prefix_tree


@dataclass(frozen=True, eq=False)
class DepthPlan:
    """The rows of MTP depth ``depth`` (>= 1) of a plan (CPU tensors; :meth:`to` moves them).

    Shapes: ``T_k`` depth-k rows, ``N`` original tokens.

    Attributes:
        depth: k.
        plan: a :class:`TreePlan` over the depth-k rows (its ``input_ids`` are packed row ids
            of the original plan; its ``position_ids`` the depth-k RoPE positions).
        rows: ``[T_k]`` the original packed row naming each depth-k row (its token is the
            embedding input).
        source: ``[T_k]`` the row of depth k-1 whose output feeds each depth-k row (depth 0:
            the original packed rows; depth >= 2: rows of the previous :class:`DepthPlan`).
        tokens: per original token, the depth-k row it reads and its label ``x[i+k+1]``
            (``next_token_mask`` False where there is none).
    """

    depth: int
    plan: TreePlan
    rows: torch.Tensor
    source: torch.Tensor
    tokens: LocalTokenRows

    @property
    def num_rows(self) -> int:
        return self.plan.num_tokens

    def to(self, device) -> "DepthPlan":
        return DepthPlan(self.depth, self.plan.to(device), self.rows.to(device), self.source.to(device),
                         self.tokens.to(device))


def depth_plans(plan: TreePlan, num_depths: int) -> list[DepthPlan]:
    """:class:`DepthPlan` of depths ``1..num_depths`` (a depth no sequence reaches is left
    out of the list's tail). Built on the plan's host copy."""
    host = plan.host
    lens = np.asarray(host.seq_lens, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    unpack = host.unpack_index.cpu().numpy().astype(np.int64)
    n = int(offsets[-1])
    previous_row = np.full(host.num_tokens, -1, dtype=np.int64)  # the row before each row on its path
    starts = np.zeros(n, dtype=bool)
    starts[offsets[:-1][lens > 0]] = True
    previous_row[unpack[1:][~starts[1:]]] = unpack[:-1][~starts[1:]]
    position = np.arange(n) - np.repeat(offsets[:-1], lens)
    length = np.repeat(lens, lens)
    next_ids = host.next_token_ids.cpu().numpy()
    index_of_row = np.arange(host.num_tokens)  # depth 0: a row is its own index
    out = []
    for k in range(1, num_depths + 1):
        reach = lens > k
        if not reach.any():
            break
        sequences = [unpack[offsets[s] + k: offsets[s + 1]] for s in np.flatnonzero(reach)]
        sub = plan_prefix_tree(sequences, min_prefix_len=1)
        rows = sub.input_ids.numpy()
        source = index_of_row[previous_row[rows]]
        # original token (s, i) with i + k < len(s) reads sub-row of (s, i): sub's tokens are
        # those, in batch order
        has_row = position + k < length
        token_row = np.zeros(n, dtype=np.int64)
        token_row[has_row] = sub.unpack_index.numpy()
        labelled = position + k + 1 < length
        labels = np.zeros(n, dtype=np.int64)
        labels[labelled] = next_ids[np.flatnonzero(labelled) + k]
        tokens = LocalTokenRows(
            num_tokens=sub.num_tokens,
            unpack_index=torch.from_numpy(token_row),
            next_token_ids=torch.from_numpy(labels),
            next_token_mask=torch.from_numpy(labelled),
            max_token_id=host.max_token_id,
            token_index=torch.arange(n),
        )
        out.append(DepthPlan(k, sub, torch.from_numpy(rows), torch.from_numpy(source), tokens))
        index_of_row = np.full(host.num_tokens, -1, dtype=np.int64)
        index_of_row[rows] = np.arange(len(rows))
    return out


def rolled_mask(mask: torch.Tensor, seq_lens, shift: int) -> torch.Tensor:
    """``[N]`` per-token ``mask`` moved ``shift`` tokens left within each sequence (0 past the
    end): what megatron's ``roll_tensor`` does to a packed loss mask, ``shift`` times."""
    lens = torch.as_tensor(seq_lens, dtype=torch.long)
    n = int(lens.sum())
    position = torch.arange(n) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    inside = position + shift < torch.repeat_interleave(lens, lens)
    source = torch.where(inside, torch.arange(n) + shift, 0).to(mask.device)
    return torch.where(inside.to(mask.device), mask[source], torch.zeros((), dtype=mask.dtype, device=mask.device))
