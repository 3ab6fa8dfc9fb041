"""Tree attention vs. the unshared baseline, each kernel and layout side by side, fwd+bwd.

    python benchmarks/attention.py [--heads 16 --kv-heads 2 --head-dim 128] [--flex] [--sweep] [--out FILE]

One table, one row per standard workload (progress on stderr). Kernels: torch's flash kernel
(``fa``: FA2 through ``torch.ops.aten._flash_attention_*``) and cuDNN fused attention through
Transformer Engine (``cudnn``; its columns print "-" where TE cannot run). Columns:

* base fa / base cudnn: the unshared batch in THD (one causal segment per sequence, no gather)
  through each kernel;
* fa cascade, fa gather: the tree with torch flash forced into each layout; cudnn gather, and
  cudnn cascade where the plan is a chain forest (0 levels: the one causal self call; cuDNN does
  not run level calls); each "m/i" is its speedup over the *same kernel's* unshared baseline
  divided by the ideal (attention-FLOP ratio);
* auto: what ``tree_attention(backend="auto")`` runs (kernel/layout picked by
  ``kernel_choice.prefers_cudnn`` and ``layout.cascade_pays``), its m/i against the *faster*
  of the two unshared baselines;
* every ms column is timed with the steps queued back to back (``common.time_ms(queued=True)``,
  as ``triton.testing.do_bench`` times kernels): what attention costs inside a model whose host
  runs ahead of the GPU; ``synced ms`` / ``synced m/i``: the auto step and the baselines timed
  with a sync after every step instead (the host's launch latency included);
* err: the largest relative difference (output, dq, dk, dv) of every tree column against
  fa gather on the same inputs;
* base fa4 / fa4: FlashAttention-4 (the flash-attn-4 package, where installed) on the unshared
  batch and on the tree in torch flash's layout choice (backend ``"fa4"``), m/i against base fa4;
* flex (``--flex``, compiles), PG = PrefixGrouper on the GRPO workloads (torch varlen flash
  underneath; m/i against base fa); MiB = peak memory above the inputs per step.

``--window W``, ``--sinks``, ``--softcap C``: the attention variants instead (sliding window,
per-head sink logits, logit softcapping): one row per workload, per backend (varlen = torch's
flash kernel, cudnn, fa4, flex with ``--flex``) the unshared batch with the same variant
("base"), the tree ("tree", in auto's layout: gather-KV cut to the window where a window meets
cascade level calls), m/i against the windowed attention-FLOP ratio, the tree's peak MiB, and
"err": the largest relative difference (output, dq, dk, dv) of each tree column against varlen's
tree; a backend that cannot run the variant prints "-" (the refusal goes to stderr).

``--sweep``: the kernel-choice evidence: per workload and length scale (0.5, 1, 2), the shape
numbers the rule reads (work = pairs x Hq x D, pairs per segment), torch flash and cuDNN each
in its own layout choice, which was faster and what the rule picks.
``--sweep-chunking``: cascade timings under other level-chunking constants.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, peak_mib, time_ms, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared, tree_attention  # noqa: E402
from ps_mcore.attention import auto_choice  # noqa: E402
from ps_mcore.attention.cascade import tree_varlen_attention  # noqa: E402
from ps_mcore.attention.gather_kv import default_scale, flash_kernel_for  # noqa: E402
from ps_mcore.attention.kernel_choice import CUDNN_MIN_WORK, plan_shape, prefers_cudnn  # noqa: E402
from ps_mcore.attention.layout import cascade_layout  # noqa: E402
from ps_mcore.workloads import WORKLOADS, make_workload  # noqa: E402

GRPO = ("grpo-long-prompt", "grpo-wide", "grpo-math")
DEVICE = "cuda"  # a CPU dry run of the table code sets "cpu" (and stands kernels in)
NAN = float("nan")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fwd_bwd(fn, inputs, grad):
    def step():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(grad)

    return step


def leaves(shape_q, shape_kv, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    mk = lambda s: torch.randn(s, device=DEVICE, dtype=dtype, generator=g).requires_grad_()  # noqa: E731
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


def kernel_refusal(refusal_of, hq: int, d: int, dtype) -> str | None:
    """Why a kernel's columns cannot run here (None: they can): its backend's
    ``*_refusal`` asked about a ``[1, hq, d]`` query of ``dtype``."""
    return refusal_of(torch.zeros(1, hq, d, device=DEVICE, dtype=dtype))


def tree_fns(plan, scale, use_cudnn: bool, flex: bool, fa4: bool = False) -> dict:
    """Column name -> ``(q, k, v) -> out`` over the tree plan; None where it cannot run."""
    from ps_mcore.attention.cudnn import cudnn_tree_attention

    kernel = flash_kernel_for(torch.device(DEVICE))
    chain_forest = cascade_layout(plan).num_levels == 0
    fns = {
        "fa cascade": lambda q, k, v: tree_varlen_attention(q, k, v, plan, scale, kernel, layout="cascade"),
        "fa gather": lambda q, k, v: tree_varlen_attention(q, k, v, plan, scale, kernel, layout="gather"),
        "cudnn gather": (lambda q, k, v: cudnn_tree_attention(q, k, v, plan, scale, layout="gather")) if use_cudnn else None,
        "cudnn cascade": (
            (lambda q, k, v: cudnn_tree_attention(q, k, v, plan, scale, layout="cascade"))
            if use_cudnn and chain_forest else None
        ),
        "fa4": (lambda q, k, v: tree_attention(q, k, v, plan, backend="fa4")) if fa4 else None,
        "auto": lambda q, k, v: tree_attention(q, k, v, plan, backend="auto"),
        "flex": (lambda q, k, v: tree_attention(q, k, v, plan, backend="flex")) if flex else None,
    }
    return fns


def largest_difference(fns: dict, reference: str, q, k, v, grad) -> float:
    """Largest relative difference (output and the three gradients) of every column in ``fns``
    against ``fns[reference]`` on the same inputs."""
    results = {}
    for name, fn in fns.items():
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*x)
        out.backward(grad)
        results[name] = [out.detach()] + [t.grad for t in x]
        del out, x
    ref = results.pop(reference)
    worst = 0.0
    for got in results.values():
        for a, b in zip(got, ref):
            worst = max(worst, ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item())
    return worst


HEADERS = [
    "workload", "N", "T", "levels", "ideal", "base fa ms", "base cudnn ms",
    "fa cascade ms", "m/i", "fa gather ms", "m/i", "cudnn gather ms", "m/i", "cudnn cascade ms", "m/i",
    "base fa4 ms", "fa4 ms", "m/i",
    "auto", "auto ms", "auto m/i", "synced ms", "synced m/i", "err", "flex ms", "m/i", "PG ms", "m/i",
    "base fa MiB", "base cudnn MiB", "auto MiB", "fa cascade MiB", "fa gather MiB", "cudnn gather MiB", "fa4 MiB",
    "flex MiB", "PG MiB",
]
# tree column -> the unshared baseline its m/i is measured against
_OWN_BASE = {"fa cascade": "base fa", "fa gather": "base fa", "cudnn gather": "base cudnn",
             "cudnn cascade": "base cudnn", "fa4": "base fa4", "flex": "base fa", "pg": "base fa"}


def measure_workload(name: str, args, use_cudnn: bool) -> list:
    dtype = torch.bfloat16
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    w = make_workload(name, seed=args.seed, scale=args.scale)
    plan = plan_prefix_tree(w.sequences).to(DEVICE)
    base_plan = plan_unshared(w.sequences).to(DEVICE)
    stats = plan.stats()
    n, t = stats["N"], stats["T"]
    ideal = stats["attn_flop_ratio"]

    qb, kb, vb = leaves((n, hq, d), (n, hkv, d), dtype, 1)
    gb = torch.randn(n, hq, d, device=DEVICE, dtype=dtype)
    base = {"base fa": fwd_bwd(lambda q, k, v: tree_attention(q, k, v, base_plan, backend="varlen"), (qb, kb, vb), gb)}
    if use_cudnn:
        base["base cudnn"] = fwd_bwd(lambda q, k, v: tree_attention(q, k, v, base_plan, backend="cudnn"), (qb, kb, vb), gb)

    qt, kt, vt = leaves((t, hq, d), (t, hkv, d), dtype, 2)
    gt = torch.randn(t, hq, d, device=DEVICE, dtype=dtype)
    if args.fa4:
        base["base fa4"] = fwd_bwd(lambda q, k, v: tree_attention(q, k, v, base_plan, backend="fa4"), (qb, kb, vb), gb)
    fns = {k: f for k, f in tree_fns(plan, default_scale(d), use_cudnn, args.flex, args.fa4).items() if f is not None}
    err = largest_difference(fns, "fa gather", qt, kt, vt, gt)
    steps = dict(base)
    steps.update({k: fwd_bwd(f, (qt, kt, vt), gt) for k, f in fns.items()})
    if name in args.profile:
        profile(steps["auto"], f"tree auto ({'/'.join(auto_choice(qt, plan))}) fwd+bwd, {name}")
    if name in GRPO and not args.no_prefix_grouper:
        steps["pg"] = prefix_grouper_step(w, hq, hkv, d, dtype)
    ms, mem = {}, {}
    for key, step in steps.items():
        log(f"    {key}")
        ms[key], mem[key] = time_ms(step, args.warmup, args.iters, queued=True), peak_mib(step)
    synced = {key: time_ms(steps[key], args.warmup, args.iters) for key in ("base fa", "base cudnn", "auto") if key in steps}

    def get(table, key):
        return table.get(key, NAN)

    def m_i(key, base_ms):
        return base_ms / ms[key] / ideal if key in ms else NAN

    best_base = min(get(ms, "base fa"), get(ms, "base cudnn")) if use_cudnn else get(ms, "base fa")
    row = [name, n, t, cascade_layout(plan).num_levels, ideal, get(ms, "base fa"), get(ms, "base cudnn")]
    for key in ("fa cascade", "fa gather", "cudnn gather", "cudnn cascade"):
        row += [get(ms, key), m_i(key, get(ms, _OWN_BASE[key]))]
    row += [get(ms, "base fa4"), get(ms, "fa4"), m_i("fa4", get(ms, "base fa4"))]
    row += ["/".join(auto_choice(qt, plan)), get(ms, "auto"), m_i("auto", best_base)]
    best_synced = min(synced.get("base fa", NAN), synced.get("base cudnn", NAN)) if use_cudnn else synced["base fa"]
    row += [synced["auto"], best_synced / synced["auto"] / ideal, err]
    for key in ("flex", "pg"):
        row += [get(ms, key), m_i(key, get(ms, _OWN_BASE[key]))]
    row += [get(mem, k) for k in ("base fa", "base cudnn", "auto", "fa cascade", "fa gather", "cudnn gather", "fa4", "flex", "pg")]
    return row


def sweep_kernel_choice(args, use_cudnn: bool) -> str:
    """Per workload and length scale: the rule's inputs, both kernels (each in its own layout
    choice: flash by ``cascade_pays``, cuDNN gather-KV or the chain call), the faster, the pick."""
    from ps_mcore.attention.cudnn import cudnn_tree_attention

    if not use_cudnn:
        return "\n\nKernel-choice sweep: skipped (cuDNN unavailable).\n"
    dtype, hq, hkv, d = torch.bfloat16, args.heads, args.kv_heads, args.head_dim
    scale = default_scale(d)
    kernel = flash_kernel_for(torch.device(DEVICE))
    rows = []
    for name in args.workloads:
        for factor in (0.5, 1.0, 2.0):
            log(f"  sweep {name} x{factor}")
            w = make_workload(name, seed=args.seed, scale=args.scale * factor)
            plan = plan_prefix_tree(w.sequences).to(DEVICE)
            shape = plan_shape(plan, hq, d)
            t = plan.num_tokens
            q, k, v = leaves((t, hq, d), (t, hkv, d), dtype, 3)
            g = torch.randn(t, hq, d, device=DEVICE, dtype=dtype)
            fa = time_ms(fwd_bwd(lambda q, k, v, p=plan: tree_varlen_attention(q, k, v, p, scale, kernel), (q, k, v), g),
                         args.warmup, args.iters, queued=True)
            cd = time_ms(fwd_bwd(lambda q, k, v, p=plan: cudnn_tree_attention(q, k, v, p, scale), (q, k, v), g),
                         args.warmup, args.iters, queued=True)
            faster = "cudnn" if cd < fa else "fa"
            pick = "cudnn" if prefers_cudnn(shape) else "fa"
            rows.append([name, factor, t, shape.segments, shape.levels, "cascade" if shape.cascade else "gather",
                         shape.work, shape.pairs / shape.segments, fa, cd, cd / fa, faster, pick,
                         "yes" if faster == pick else "NO"])
            del q, k, v, g
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    headers = ["workload", "scale", "T", "segments", "levels", "fa layout", "work", "pairs/seg", "fa ms",
               "cudnn ms", "cudnn/fa", "faster", "rule", "agree"]
    return (f"\n\nKernel-choice sweep (CUDNN_MIN_WORK = {CUDNN_MIN_WORK:.3g}; work = pairs x Hq x D; "
            f"the rule keeps flash where it runs a cascade with levels):\n\n{markdown_table(headers, rows)}\n"
            f"\n{crossover_fit(rows)}\n")


def crossover_fit(rows: list) -> str:
    """Least-squares ``cudnn_ms = a + r * fa_ms`` over the sweep rows and the crossover it
    implies (flash ms ``a / (1 - r)``, and the work there, interpolated in log-log)."""
    import numpy as np

    fa = np.array([r[8] for r in rows], dtype=float)
    cd = np.array([r[9] for r in rows], dtype=float)
    work = np.array([r[6] for r in rows], dtype=float)
    if fa.size < 2 or np.ptp(fa) == 0:
        return "fit: too few rows"
    r, a = np.polyfit(fa, cd, 1)
    if r >= 1 or a <= 0:
        return f"fit: cudnn_ms = {a:.3g} + {r:.3g} * fa_ms (no crossover: one kernel wins everywhere)"
    cross_ms = a / (1 - r)
    k, c = np.polyfit(np.log(fa), np.log(work), 1)  # work ~ exp(c) * fa_ms**k
    return (f"fit: cudnn_ms = {a:.3g} + {r:.3g} * fa_ms; crossover at fa = {cross_ms:.3g} ms, "
            f"work ~ {np.exp(c) * cross_ms**k:.3g} (CUDNN_MIN_WORK = {CUDNN_MIN_WORK:.3g})")


def sweep_level_chunking(plan, step, base_ms, ideal, args) -> list:
    """Cascade timing under other level-call chunking settings (MIN_LEVEL_KEY_BLOCKS,
    MIN_CHUNK_ROWS); the plan's cached layouts are rebuilt for each."""
    from ps_mcore.attention import layout as layout_mod

    def forget_layouts():
        for p in (plan, plan.host):
            p.memo.cascade_layouts.clear()

    saved = (layout_mod.MIN_LEVEL_KEY_BLOCKS, layout_mod.MIN_CHUNK_ROWS)
    out = []
    for blocks, rows in ((0, 512), (32, 1024), (64, 512), (128, 256)):
        layout_mod.MIN_LEVEL_KEY_BLOCKS, layout_mod.MIN_CHUNK_ROWS = blocks, rows
        forget_layouts()
        ms = time_ms(step, args.warmup, args.iters, queued=True)
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


VARIANT_BACKENDS = ("varlen", "cudnn", "fa4", "flex")


def variant_kwargs(args, hq: int) -> dict:
    """``tree_attention`` keywords of the variant asked for (sinks: fixed logits of both signs)."""
    kw = {}
    if args.window:
        kw["window"] = args.window
    if args.softcap:
        kw["softcap"] = args.softcap
    if args.sinks:
        kw["sinks"] = torch.linspace(-2.0, 2.0, hq, device=DEVICE)
    return kw


def measure_variant_workload(name: str, args) -> list:
    """One row of the variant table (module docstring)."""
    from ps_mcore.attention.variants import attention_variant

    dtype, hq, hkv, d = torch.bfloat16, args.heads, args.kv_heads, args.head_dim
    w = make_workload(name, seed=args.seed, scale=args.scale)
    plan = plan_prefix_tree(w.sequences).to(DEVICE)
    base_plan = plan_unshared(w.sequences).to(DEVICE)
    stats = plan.stats(window=args.window)
    n, t = stats["N"], stats["T"]
    ideal = stats["attn_flop_ratio_window"] if args.window else stats["attn_flop_ratio"]
    kw = variant_kwargs(args, hq)
    qb, kb, vb = leaves((n, hq, d), (n, hkv, d), dtype, 1)
    gb = torch.randn(n, hq, d, device=DEVICE, dtype=dtype)
    qt, kt, vt = leaves((t, hq, d), (t, hkv, d), dtype, 2)
    gt = torch.randn(t, hq, d, device=DEVICE, dtype=dtype)
    variant = attention_variant(qt, kw.get("window"), kw.get("sinks"), kw.get("softcap"))
    backends = [b for b in VARIANT_BACKENDS if b != "flex" or args.flex]
    tree, steps = {}, {}
    for b in backends:
        try:
            tree_attention(qt, kt, vt, plan, backend=b, **kw)  # a refusal surfaces here
        except (ValueError, RuntimeError) as e:
            log(f"  {b}: {e}")
            continue
        tree[b] = lambda q, k, v, b=b: tree_attention(q, k, v, plan, backend=b, **kw)
        steps[f"base {b}"] = fwd_bwd(lambda q, k, v, b=b: tree_attention(q, k, v, base_plan, backend=b, **kw),
                                     (qb, kb, vb), gb)
        steps[b] = fwd_bwd(tree[b], (qt, kt, vt), gt)
    err = largest_difference(tree, "varlen", qt, kt, vt, gt) if "varlen" in tree and len(tree) > 1 else NAN
    ms, mem = {}, {}
    for key, step in steps.items():
        log(f"    {key}")
        ms[key], mem[key] = time_ms(step, args.warmup, args.iters, queued=True), peak_mib(step)
    row = [name, n, t, ideal, "/".join(auto_choice(qt, plan, variant))]
    for b in VARIANT_BACKENDS:
        base_ms, tree_ms = ms.get(f"base {b}", NAN), ms.get(b, NAN)
        row += [base_ms, tree_ms, base_ms / tree_ms / ideal, mem.get(b, NAN)]
    return row + [err]


def run_variants(args) -> str:
    headers = ["workload", "N", "T", "ideal", "auto"]
    for b in VARIANT_BACKENDS:
        headers += [f"base {b} ms", f"{b} ms", "m/i", f"{b} MiB"]
    headers.append("err")
    rows = []
    for i, name in enumerate(args.workloads):
        log(f"[{i + 1}/{len(args.workloads)}] {name}")
        rows.append(measure_variant_workload(name, args))
        torch.cuda.empty_cache()
    what = ", ".join(f"{k} {v}" for k, v in (("window", args.window), ("softcap", args.softcap)) if v)
    what += (", " if what else "") + ("per-head sinks" if args.sinks else "")
    title = (f"Attention variants ({what}) only, fwd+bwd, bf16, Hq={args.heads}, Hkv={args.kv_heads}, "
             f"D={args.head_dim}; ideal = the {'windowed ' if args.window else ''}attention-FLOP ratio")
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}\n"


def run(args) -> str:
    if args.window or args.sinks or args.softcap:
        return run_variants(args)
    torch._dynamo.config.cache_size_limit = 64
    from ps_mcore.attention.cudnn import cudnn_refusal
    from ps_mcore.attention.fa4 import fa4_refusal

    reason = kernel_refusal(cudnn_refusal, args.heads, args.head_dim, torch.bfloat16)
    use_cudnn = reason is None
    if not use_cudnn:
        log(f"cuDNN columns print '-': {reason}")
    fa4 = kernel_refusal(fa4_refusal, args.heads, args.head_dim, torch.bfloat16)
    args.fa4 = fa4 is None
    if fa4:
        log(f"FA4 columns print '-': {fa4}")
    rows, sweeps = [], []
    for i, name in enumerate(args.workloads):
        log(f"[{i + 1}/{len(args.workloads)}] {name}")
        rows.append(measure_workload(name, args, use_cudnn))
        if args.sweep_chunking:
            sweeps.append(chunking_sweep_line(name, args))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    title = f"Attention only, fwd+bwd, bf16, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}"
    te = ("" if use_cudnn else f" (cuDNN columns: {reason})") + ("" if args.fa4 else f" (FA4 columns: {fa4})")
    out = f"{title}{te}\n\n{environment()}\n\n{markdown_table(HEADERS, rows)}\n"
    sweeps = [line for line in sweeps if line]
    if sweeps:
        out += "\nCascade level chunking (MIN_LEVEL_KEY_BLOCKS/MIN_CHUNK_ROWS: ms (meas/ideal)):\n" + "\n".join(sweeps) + "\n"
    if args.sweep:
        out += sweep_kernel_choice(args, use_cudnn)
    return out


def chunking_sweep_line(name: str, args) -> str:
    """One workload's cascade timing under other level-chunking constants ("" without levels)."""
    dtype, hq, hkv, d = torch.bfloat16, args.heads, args.kv_heads, args.head_dim
    w = make_workload(name, seed=args.seed, scale=args.scale)
    plan = plan_prefix_tree(w.sequences).to(DEVICE)
    if not cascade_layout(plan).num_levels:
        return ""
    stats = plan.stats()
    base_plan = plan_unshared(w.sequences).to(DEVICE)
    n, t = stats["N"], stats["T"]
    qb, kb, vb = leaves((n, hq, d), (n, hkv, d), dtype, 1)
    base_ms = time_ms(fwd_bwd(lambda q, k, v: tree_attention(q, k, v, base_plan, backend="varlen"), (qb, kb, vb),
                              torch.randn(n, hq, d, device=DEVICE, dtype=dtype)), args.warmup, args.iters, queued=True)
    kernel, scale = flash_kernel_for(torch.device(DEVICE)), default_scale(d)
    step = fwd_bwd(lambda q, k, v: tree_varlen_attention(q, k, v, plan, scale, kernel, layout="cascade"),
                   leaves((t, hq, d), (t, hkv, d), dtype, 2), torch.randn(t, hq, d, device=DEVICE, dtype=dtype))
    return f"{name}: " + ", ".join(sweep_level_chunking(plan, step, base_ms, stats["attn_flop_ratio"], args))


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
    p.add_argument("--scale", type=float, default=1.0, help="workload length scale (1 = the standard sizes)")
    p.add_argument("--sweep", action="store_true", help="also print the kernel-choice evidence (flash vs cuDNN by shape)")
    p.add_argument("--sweep-chunking", action="store_true", help="also time cascade level-chunking settings")
    p.add_argument("--profile", nargs="*", default=[], help="workloads to profile (kernel table)")
    p.add_argument("--window", type=int, help="variant table: a sliding window of W positions")
    p.add_argument("--sinks", action="store_true", help="variant table: per-head attention-sink logits")
    p.add_argument("--softcap", type=float, help="variant table: logit softcapping at C")
    p.add_argument("--out", help="also write the table (markdown) here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    report = run(args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
