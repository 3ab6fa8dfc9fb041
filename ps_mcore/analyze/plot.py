"""``--plot``: a picture of one micro-batch's prefix forest (needs matplotlib)."""

from __future__ import annotations

import numpy as np

from ps_mcore.analyze.read import AnalyzeError
from ps_mcore.planner import TreePlan


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise AnalyzeError("--plot needs matplotlib (pip install matplotlib, or ps-mcore[plot])") from None
    return matplotlib


def node_layout(plan: TreePlan) -> dict[str, np.ndarray]:
    """Icicle layout of the plan's forest, one entry per node (pre-order).

    Returns arrays ``[M]``: ``start`` (first position), ``length`` (tokens), ``count``
    (sequences passing through), ``y`` (first sequence row the node covers); a node covers
    rows ``y .. y + count``: first the sequences ending on it, then its children side by side.
    And ``row`` ``[B]``: the row of each sequence (batch order).
    """
    cu = plan.cu_seqlens_q.numpy().astype(np.int64)
    length = np.diff(cu)
    start = plan.position_ids.numpy()[cu[:-1]]
    parent = plan.node_parent.numpy()
    m = len(length)
    last_rows = plan.unpack_index.numpy()[np.cumsum(plan.seq_lens) - 1]
    end_node = np.searchsorted(cu, last_rows, side="right") - 1
    ends = np.bincount(end_node, minlength=m)
    count = ends.copy()
    for v in range(m - 1, -1, -1):  # children follow parents in pre-order
        if parent[v] >= 0:
            count[parent[v]] += count[v]
    y = np.zeros(m, dtype=np.int64)
    cursor = np.zeros(m, dtype=np.int64)  # next free row for each node's next child
    root_cursor = 0
    for v in range(m):
        p = parent[v]
        if p < 0:
            y[v], root_cursor = root_cursor, root_cursor + count[v]
        else:
            y[v] = cursor[p]
            cursor[p] += count[v]
        cursor[v] = y[v] + ends[v]
    # Sequences ending on the same node take its first rows, in batch order.
    order = np.argsort(end_node, kind="stable")
    rank_in_node = np.arange(len(order)) - np.searchsorted(end_node[order], end_node[order])
    row = np.empty(len(order), dtype=np.int64)
    row[order] = y[end_node[order]] + rank_in_node
    return {"start": start, "length": length, "count": count, "y": y, "row": row}


def plot_plan(plan: TreePlan, path: str, title: str = "") -> None:
    """Write a PNG icicle chart of ``plan`` (see :func:`plot_figure`) to ``path``."""
    import matplotlib.pyplot as plt

    fig = plot_figure(plan, title)
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise AnalyzeError(f"--plot {path}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)


def plot_figure(plan: TreePlan, title: str = ""):
    """The icicle chart of ``plan`` as a matplotlib figure: x = token position, one row per
    sequence, a box per tree node spanning the sequences that share it, colour = how many
    share it (an integer count: the colour bar has integer ticks)."""
    matplotlib = _require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colors, ticker

    lay = node_layout(plan)
    b = plan.num_sequences
    norm = colors.Normalize(vmin=1, vmax=max(2, int(lay["count"].max())))
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(10, max(3.0, min(12.0, 0.35 * b + 1.5))), dpi=110)
    ax.barh(lay["y"], lay["length"], left=lay["start"], height=lay["count"], align="edge",
            color=cmap(norm(lay["count"])), edgecolor="white", linewidth=0.6)
    longest = max(plan.seq_lens)
    for s, ln, c, y in zip(lay["start"], lay["length"], lay["count"], lay["y"]):
        if c > 1 and ln > 0.08 * longest:  # label only boxes wide enough to read
            ax.text(s + ln / 2, y + c / 2, f"{ln} tok x {c}", ha="center", va="center",
                    color="black" if norm(c) > 0.6 else "white", fontsize=8)
    ax.set_xlim(0, longest)
    ax.set_ylim(b, 0)
    if b <= 48:  # name the rows by batch index (the layout groups sharers together)
        ax.set_yticks(lay["row"] + 0.5, [str(i) for i in range(b)], fontsize=7)
    ax.set_xlabel("token position")
    ax.set_ylabel("sequence (index in the micro-batch)")
    st = plan.stats()
    ax.set_title(f"{title}\nN = {st['N']}, T = {st['T']}, dedup {st['dedup']:.2f}x, "
                 f"attention-FLOP ratio {st['attn_flop_ratio']:.2f}x", fontsize=10)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="sequences sharing",
                 ticks=ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    return fig
