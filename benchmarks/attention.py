"""Tree attention vs. the unshared varlen baseline (and flex, PrefixGrouper), fwd+bwd.

    python benchmarks/attention.py [--heads 16 --kv-heads 2 --head-dim 128] [--out FILE]

For every standard workload: (a) the unshared baseline, varlen flash attention over all N tokens
with one segment per sequence (the same flash kernel and call path as the tree, no gather);
(b) tree ``varlen`` (what ``tree_attention`` runs: the layout ``cascade_pays`` picks); (c) the
same kernel forced into the cascade layout and (d) into the gather-KV layout; (e) tree
``flex`` (``--flex``);
(f) PrefixGrouper (pip ``prefix-grouper``, the same varlen kernel underneath) on the GRPO
workloads. Ideal speedup = attention-FLOP ratio; measured/ideal = speedup / ideal. "err" is
the largest relative difference (output, dq, dk, dv) between the two tree layouts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, peak_mib, time_ms, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared, tree_attention  # noqa: E402
from ps_mcore.attention.cascade import tree_varlen_attention  # noqa: E402
from ps_mcore.attention.gather_kv import default_scale, flash_kernel_for  # noqa: E402
from ps_mcore.attention.layout import cascade_layout  # noqa: E402
from ps_mcore.workloads import WORKLOADS, make_workload  # noqa: E402

GRPO = ("grpo-long-prompt", "grpo-wide", "grpo-math")


def fwd_bwd(fn, inputs, grad):
    def step():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(grad)

    return step


def leaves(shape_q, shape_kv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s: torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_()  # noqa: E731
    return mk(shape_q), mk(shape_kv), mk(shape_kv)


def prefix_grouper_step(w, hq, hkv, d, dtype):
    """PrefixGrouper's grouped layout [G, H, prefix+suffixes, D], its ungroup/group and two
    attention calls, with varlen flash underneath (what its flash_attention_2 path does)."""
    from prefix_grouper import PrefixGrouper

    groups: dict[int, list[int]] = {}
    for i, g in enumerate(w.group_ids):
        groups.setdefault(g, []).append(i)
    info = [[w.prompt_lens[m[0]]] + [len(w.sequences[i]) - w.prompt_lens[i] for i in m] for m in groups.values()]
    pg = PrefixGrouper(info, device="cuda")
    g, length = pg.x_shape

    def attn(q, k, v, mask, *args, **kwargs):  # q [b, H, Lq, D], mask [b, Lk] (True = token)
        lq = q.size(2)
        qmask = mask[:, -lq:]
        cu_q = torch.nn.functional.pad(qmask.sum(1).cumsum(0), (1, 0)).int()
        cu_k = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0)).int()
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(
            q.transpose(1, 2)[qmask], k.transpose(1, 2)[mask], v.transpose(1, 2)[mask],
            cu_q, cu_k, int(qmask.sum(1).max()), int(mask.sum(1).max()), window_size=(-1, 0),
        )
        full = out.new_zeros(q.size(0), lq, q.size(1), q.size(3))
        full[qmask] = out
        return full

    q, k, v = leaves((g, hq, length, d), (g, hkv, length, d), dtype, 0)
    grad = torch.randn(g, length, hq, d, device="cuda", dtype=dtype)
    return fwd_bwd(lambda q, k, v: pg.forward(attn, q, k, v), (q, k, v), grad)


def layout_difference(plan, q, k, v, grad) -> float:
    """Largest relative difference (output and the three gradients) between the tree's
    cascade and gather-KV layouts on the same inputs."""
    kernel, scale = flash_kernel_for(q.device), default_scale(q.size(-1))
    results = []
    for layout in ("cascade", "gather"):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = tree_varlen_attention(*x, plan, scale, kernel, layout=layout)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in x])
    return max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(*results))


def sweep_level_chunking(plan, step, base_ms, ideal, args) -> list:
    """Cascade timing under other level-call chunking settings (MIN_LEVEL_KEY_BLOCKS,
    MIN_CHUNK_ROWS); the plan's cached layouts are rebuilt for each."""
    from ps_mcore.attention import layout as layout_mod

    def forget_layouts():
        for p in (plan, plan._cache.get("host", plan)):
            for key in [k for k in p._cache if isinstance(k, tuple) and k[0] == "cascade_layout"]:
                del p._cache[key]

    saved = (layout_mod.MIN_LEVEL_KEY_BLOCKS, layout_mod.MIN_CHUNK_ROWS)
    out = []
    for blocks, rows in ((0, 512), (32, 1024), (64, 512), (128, 256)):
        layout_mod.MIN_LEVEL_KEY_BLOCKS, layout_mod.MIN_CHUNK_ROWS = blocks, rows
        forget_layouts()
        ms = time_ms(step, args.warmup, args.iters)
        out.append(f"{blocks}/{rows}: {ms:.3g} ms ({base_ms / ms / ideal:.3f})")
    layout_mod.MIN_LEVEL_KEY_BLOCKS, layout_mod.MIN_CHUNK_ROWS = saved
    forget_layouts()
    return out


def profile(step, title: str) -> None:
    """Print where the time of one step goes (CUDA kernels, summed over 5 steps)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(title)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def run(args) -> str:
    torch._dynamo.config.cache_size_limit = 64
    dtype = torch.bfloat16
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    headers = ["workload", "N", "T", "dedup", "levels", "ideal", "base ms", "varlen ms", "speedup",
               "meas/ideal", "cascade ms", "cascade m/i", "gather ms", "gather m/i", "err", "flex ms", "PG ms", "base MiB",
               "varlen MiB", "gather MiB", "flex MiB", "PG MiB"]
    rows, sweeps = [], []
    for i, name in enumerate(args.workloads):
        print(f"[{i + 1}/{len(args.workloads)}] {name}", flush=True)
        w = make_workload(name, seed=args.seed)
        plan = plan_prefix_tree(w.sequences).to("cuda")
        base_plan = plan_unshared(w.sequences).to("cuda")
        stats = plan.stats()
        n, t = stats["N"], stats["T"]

        qb, kb, vb = leaves((n, hq, d), (n, hkv, d), dtype, 1)
        gb = torch.randn(n, hq, d, device="cuda", dtype=dtype)
        base = fwd_bwd(lambda q, k, v: tree_attention(q, k, v, base_plan, backend="varlen"), (qb, kb, vb), gb)

        qt, kt, vt = leaves((t, hq, d), (t, hkv, d), dtype, 2)
        gt = torch.randn(t, hq, d, device="cuda", dtype=dtype)
        kernel, scale = flash_kernel_for(qt.device), default_scale(d)
        tree = {
            "varlen": fwd_bwd(lambda q, k, v: tree_attention(q, k, v, plan, backend="varlen"), (qt, kt, vt), gt),
        }
        for layout in ("cascade", "gather"):
            tree[layout] = fwd_bwd(
                lambda q, k, v, lay=layout: tree_varlen_attention(q, k, v, plan, scale, kernel, layout=lay),
                (qt, kt, vt), gt,
            )
        if args.flex:
            tree["flex"] = fwd_bwd(lambda q, k, v: tree_attention(q, k, v, plan, backend="flex"), (qt, kt, vt), gt)
        err = layout_difference(plan, qt, kt, vt, gt)
        if name in args.profile:
            profile(tree["varlen"], f"tree varlen (auto layout) fwd+bwd, {name}")
        ms = {"base": time_ms(base, args.warmup, args.iters)}
        mem = {"base": peak_mib(base)}
        for backend, step in tree.items():
            ms[backend] = time_ms(step, args.warmup, args.iters)
            mem[backend] = peak_mib(step)
        ms.setdefault("flex", float("nan")), mem.setdefault("flex", float("nan"))
        ms["pg"] = mem["pg"] = float("nan")
        if name in GRPO and not args.no_prefix_grouper:
            step = prefix_grouper_step(w, hq, hkv, d, dtype)
            ms["pg"], mem["pg"] = time_ms(step, args.warmup, args.iters), peak_mib(step)
        ideal = stats["attn_flop_ratio"]
        speedup = ms["base"] / ms["varlen"]
        if args.sweep and cascade_layout(plan).num_levels:
            sweeps.append(f"{name}: " + ", ".join(sweep_level_chunking(plan, tree["cascade"], ms["base"], ideal, args)))
        rows.append([name, n, t, stats["dedup"], cascade_layout(plan).num_levels, ideal, ms["base"],
                     ms["varlen"], speedup, speedup / ideal, ms["cascade"], ms["base"] / ms["cascade"] / ideal,
                     ms["gather"], ms["base"] / ms["gather"] / ideal,
                     err, ms["flex"], ms["pg"], mem["base"], mem["varlen"], mem["gather"],
                     mem["flex"], mem["pg"]])
        del qb, kb, vb, qt, kt, vt, tree, base
        torch.cuda.empty_cache()
    title = f"Attention only, fwd+bwd, bf16, Hq={hq}, Hkv={hkv}, D={d}"
    sweep = ("\n\nCascade level chunking (MIN_LEVEL_KEY_BLOCKS/MIN_CHUNK_ROWS: ms (meas/ideal)):\n" + "\n".join(sweeps)) if sweeps else ""
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}{sweep}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-prefix-grouper", action="store_true")
    p.add_argument("--flex", action="store_true", help="also time tree flex (compiles)")
    p.add_argument("--sweep", action="store_true", help="also time cascade level-chunking settings")
    p.add_argument("--profile", nargs="*", default=[], help="workloads to profile (kernel table)")
    p.add_argument("--out", help="also write the table (markdown) here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    report = run(args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
