"""verl 0.8.0 worker batches for tests: the TensorDict layout ``left_right_2_no_padding``
produces on the trainer path (nested ``input_ids``/``position_ids``, left-padded
``prompts``, right-padded ``responses`` and masks, ``uid`` labels), for GRPO groups,
step-wise agent samples and a branching tree, plus an engine shell around a real
megatron-core GPTModel that runs verl's real Megatron engine methods."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

VOCAB = 128


def use_cpu_platform() -> None:
    """Test-only: verl 0.9.1 knows CUDA, NPU and ROCm platforms and, with none available, falls
    back to CUDA (its engines then move batches to ``cuda``); on the CPU the tests set a CPU
    platform. verl 0.8.0 falls back to the CPU by itself."""
    try:
        from verl.plugin.platform import platform_manager
        from verl.plugin.platform.platform_cuda import PlatformCUDA
    except ImportError:
        return
    if torch.cuda.is_available() or getattr(platform_manager._current_platform, "device_name", None) == "cpu":
        return

    class CPUPlatform(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def empty_cache(self):
            pass

        def communication_backend_name(self):
            return "gloo"

    platform_manager.set_platform(CPUPlatform())


use_cpu_platform()


def _tokens(rng, n):
    return rng.integers(1, VOCAB, size=n).tolist()


def grpo_samples(rng, prompts=2, group=3):
    """``prompts`` prompts x ``group`` responses: (prompt, response, uid) triples."""
    out = []
    for p in range(prompts):
        prompt = _tokens(rng, int(rng.integers(9, 14)))
        for _ in range(group):
            out.append((prompt, _tokens(rng, int(rng.integers(3, 9))), f"uid{p}"))
    return out


def stepwise_samples(rng, steps=4):
    """One trajectory; sample k = prompt + steps 1..k (each a prefix of the next)."""
    prompt = _tokens(rng, 7)
    steps_tokens = [_tokens(rng, int(rng.integers(4, 7))) for _ in range(steps)]
    return [(prompt, sum(steps_tokens[: k + 1], []), "traj") for k in range(steps)]


def tree_samples(rng):
    """A prompt branching twice (2 x 2 leaves) plus a duplicate leaf and an unrelated one."""
    prompt = _tokens(rng, 8)
    out = []
    for _ in range(2):
        turn = _tokens(rng, 5)
        for _ in range(2):
            out.append((prompt, turn + _tokens(rng, int(rng.integers(2, 6))), "tree"))
    out.append(out[1])
    out.append((_tokens(rng, 6), _tokens(rng, 3), "other"))
    return out


def long_units(rng):
    """Sharing units larger than a token budget of 40: two GRPO groups whose prompt is most of
    it (each unit 2-3 budgets large), a step-wise trajectory longer than it and a small group
    that fits, shuffled."""
    samples = []
    for g in range(2):
        prompt = _tokens(rng, 26)
        samples += [(prompt, _tokens(rng, int(rng.integers(4, 10))), f"g{g}") for _ in range(5)]
    steps = [_tokens(rng, 6) for _ in range(5)]
    samples += [(_tokens(rng, 8), sum(steps[: k + 1], []), "traj") for k in range(5)]
    prompt = _tokens(rng, 6)
    samples += [(prompt, _tokens(rng, 3), "small") for _ in range(2)]
    order = rng.permutation(len(samples))
    return [samples[i] for i in order]


def header_bound_groups(rng, groups=6, group=4, header=5, response=(20, 60)):
    """GRPO groups whose prompts open with one short chat header of ``header`` tokens: under
    ``arbitrary_prefix`` the header binds every group into one sharing unit."""
    head = _tokens(rng, header)
    out = []
    for g in range(groups):
        prompt = head + _tokens(rng, int(rng.integers(20, 40)))
        out += [(prompt, _tokens(rng, int(rng.integers(*response))), f"q{g}") for _ in range(group)]
    return out


WORKLOADS = {"grpo": grpo_samples, "stepwise": stepwise_samples, "tree": tree_samples}


def driver_batch(samples):
    """The trainer's ``DataProto`` (what ``_balance_batch`` reorders) from (prompt, response,
    uid) triples: left-padded ``prompts``, right-padded ``responses``, their ``input_ids``
    ``[B, P+R]`` and ``attention_mask``, ``uid`` labels."""
    from verl import DataProto

    b = len(samples)
    p_max = max(len(p) for p, _, _ in samples)
    r_max = max(len(r) for _, r, _ in samples)
    ids = torch.zeros(b, p_max + r_max, dtype=torch.long)
    mask = torch.zeros(b, p_max + r_max, dtype=torch.long)
    for i, (p, r, _) in enumerate(samples):
        ids[i, p_max - len(p) : p_max + len(r)] = torch.tensor(list(p) + list(r))
        mask[i, p_max - len(p) : p_max + len(r)] = 1
    tensors = {"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :p_max], "responses": ids[:, p_max:]}
    return DataProto.from_dict(tensors, {"uid": np.array([u for _, _, u in samples], dtype=object)})


def make_batch(samples, rng, temperature=1.0, **non_tensor):
    """A verl worker TensorDict from (prompt, response, uid) triples."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    b = len(samples)
    p_max = max(len(p) for p, _, _ in samples)
    r_max = max(len(r) for _, r, _ in samples)
    prompts = torch.zeros(b, p_max, dtype=torch.long)
    responses = torch.zeros(b, r_max, dtype=torch.long)
    attention = torch.zeros(b, p_max + r_max, dtype=torch.long)
    response_mask = torch.zeros(b, r_max, dtype=torch.long)
    seqs = []
    for i, (p, r, _) in enumerate(samples):
        prompts[i, p_max - len(p) :] = torch.tensor(p)
        responses[i, : len(r)] = torch.tensor(r)
        attention[i, p_max - len(p) : p_max + len(r)] = 1
        response_mask[i, : len(r)] = 1
        seqs.append(torch.tensor(p + r))
    input_ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    position_ids = torch.nested.as_nested_tensor([torch.arange(len(s)) for s in seqs], layout=torch.jagged)
    old = torch.from_numpy(rng.normal(-2.0, 0.5, size=(b, r_max)).astype(np.float32)) * response_mask
    adv = torch.from_numpy(rng.normal(0.0, 1.0, size=(b, r_max)).astype(np.float32)) * response_mask
    tensors = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention,
        "response_mask": response_mask,
        "loss_mask": response_mask,
        "old_log_probs": old,
        "advantages": adv,
        "uid": NonTensorStack.from_list([NonTensorData(u) for _, _, u in samples]),
    }
    meta = dict(
        temperature=temperature,
        calculate_entropy=True,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=4096,
        micro_batch_size_per_gpu=b,
        global_batch_size=b,
        return_model_output=True,  # verl 0.9.1's FSDP engine drops training outputs without it
    )
    meta.update(non_tensor)
    return tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=meta)


def sample_temperatures(num_samples: int, seed: int) -> torch.Tensor:
    """``[B]`` float32 per-sample temperatures drawn from (0.6, 1.0, 1.4), so shared prefixes
    are held by samples at several temperatures (and a few at the same one)."""
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.choice([0.6, 1.0, 1.4], size=num_samples), dtype=torch.float32)


def tree_setting(min_prefix_len: int = 3):
    """Prefix sharing on (``arbitrary_prefix``, every plan taken: no savings threshold)."""
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting

    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=min_prefix_len, min_saved_fraction=0.0)
    return PrefixSharingSetting(True, config)


def with_value_targets(data, seed: int):
    """``data`` with random critic targets (``values``, ``returns``) on its response tokens."""
    gen = torch.Generator().manual_seed(seed)
    data["values"] = torch.randn(data["responses"].shape, generator=gen) * data["response_mask"]
    data["returns"] = torch.randn(data["responses"].shape, generator=gen) * data["response_mask"]
    return data


def engine_shell(cls, model, setting=None, use_remove_padding=True):
    """An instance of verl's engine class ``cls`` around ``model`` without its heavy
    ``__init__`` (no bridge, checkpoint or optimizer): the attributes its
    ``forward_backward_batch`` / ``forward_step`` read."""
    from verl.workers.config import McoreEngineConfig

    from ps_mcore.integrations.verl_common.config import ENGINE_ATTR

    engine = object.__new__(cls)
    engine_config = McoreEngineConfig(use_remove_padding=use_remove_padding)
    if setting is not None:
        object.__setattr__(engine_config, ENGINE_ATTR, setting)
    engine.engine_config = engine_config
    engine.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False),
    )
    engine.tf_config = model.config
    engine.module = [model]
    engine.mini_layer_topk_idx_list = []
    # verl 0.9.1 reads these too (unused attributes on 0.8.0)
    engine.enable_routing_replay = False
    engine.optimizer_config = {}
    engine.is_value_model = cls.__name__.endswith("ValueHead")
    return engine


def cpu_forward_backward_func():
    """Test-only stand-in for megatron's no-pipelining schedule (it allocates a CUDA
    counter): per micro-batch ``forward_step_func`` then its loss function, the loss
    divided by the micro-batch count before backward, as megatron does (a loss function that
    also returns its token count, under ``calculate_per_token_loss``: the loss as it is)."""

    def forward_backward(forward_step_func, data_iterator, model, num_microbatches, forward_only, **_):
        it = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        chunk = model[0] if isinstance(model, list) else model
        reduced = []
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(it, chunk)
            outputs = loss_func(output)
            loss, info = outputs[0], outputs[-1]
            if len(outputs) == 3 and not chunk.config.calculate_per_token_loss:
                loss = loss / outputs[1]
            if not (len(outputs) == 3 and chunk.config.calculate_per_token_loss):
                loss = loss / num_microbatches
            if not forward_only:
                loss.backward()
            reduced.append(info)
        return reduced

    return forward_backward


# ----------------------------------------------------------------------------- comparisons

RTOL, ATOL = 1e-5, 1e-6


def seq_last_mask(nested):
    """``[sum(lens)]`` bool, False at each sequence's last row."""
    lens = nested.offsets().diff().tolist()
    mask = torch.ones(sum(lens), dtype=torch.bool)
    mask[torch.tensor(np.cumsum(lens) - 1)] = False
    return mask


def assert_outputs(stock, tree, keys=("log_probs", "entropy"), scale: float = 1.0):
    """Patched step outputs equal stock (fp32 rtol 1e-5, atol 1e-6, both times ``scale``) with
    identical jagged offsets. A value head's outputs get ``atol`` 1e-5 of their largest
    magnitude instead (the rule of :func:`assert_grads`): they are O(1) sums of hidden features
    with no softmax to damp the reordered sums, and cross zero (measured noise up to 1.1e-6 of
    the largest value, which 1e-6 absolute does not cover)."""
    for key in keys:
        a, b = stock["model_output"][key], tree["model_output"][key]
        assert torch.equal(a.offsets(), b.offsets()), key
        va, vb = a.values().detach(), b.values().detach()
        assert va.dtype == vb.dtype, key
        if key == "log_probs":  # the last row of a sequence predicts nothing (verl never reads it)
            keep = seq_last_mask(a)
            assert torch.all(vb[~keep] == 0)
            va, vb = va[keep], vb[keep]
        atol = RTOL * float(va.abs().max()) if key == "values" else ATOL
        torch.testing.assert_close(vb, va, rtol=scale * RTOL, atol=scale * atol)


def assert_grads(g_stock, g_tree):
    """rtol 1e-5 with an absolute floor of 1e-5 of each tensor's largest entry: shared rows
    sum their gradients in a different order (fp32 noise measured here: <= 4e-6 of the max)."""
    assert all(g is not None for g in g_stock)
    for a, b in zip(g_stock, g_tree):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=RTOL * float(a.abs().max()))


def unshared_samples(rng, vocab, count=5, prompt=8, response=4):
    """(prompt, response, uid) samples no two of which share a first token: nothing to share at
    any ``min_prefix_len``."""
    firsts = rng.permutation(np.arange(1, vocab))[:count]
    return [([int(f)] + rng.integers(1, vocab, prompt - 1).tolist(), rng.integers(1, vocab, response).tolist(), f"u{i}")
            for i, f in enumerate(firsts)]


def unshared_batch(vocab, seed=6):
    """A worker batch of 5 samples that share nothing, split by a 30-token budget into several
    micro-batches."""
    rng = np.random.default_rng(seed)
    return make_batch(unshared_samples(rng, vocab), rng, use_dynamic_bsz=True, max_token_len_per_gpu=30)


def forbid(monkeypatch, module, *names):
    """Replace ``module``'s functions ``names`` by ones that fail the test when called."""
    def called(*args, **kwargs):
        raise AssertionError(f"one of {names} was called")

    for name in names:
        monkeypatch.setattr(module, name, called)


def stock_then_ours(run, data, setting, loss, before_ours):
    """``run(data, setting, patched, loss=None) -> (output, grads)`` of one engine: verl's
    log-prob call and training step (a fresh ``loss()`` each), then ``before_ours()``, then
    ours. Returns ``((stock, stock_train, stock_grads), (ours, ours_train, ours_grads))``."""
    runs = []
    for patched in (False, True):
        if patched:
            before_ours()
        out, _ = run(data, setting, patched)
        train, grads = run(data, setting, patched, loss())
        runs.append((out, train, grads))
    return tuple(runs)


def step_tokens(out):
    """(tokens in, tokens packed) summed over a step's prefix-sharing metrics."""
    from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED

    return sum(out["metrics"][TOKENS_IN]), sum(out["metrics"][TOKENS_PACKED])


class ValueHead(torch.nn.Module):
    """A value head in place of the LM head (what verl's value-model hook installs)."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 1, bias=False)
        torch.nn.init.normal_(self.linear.weight, std=0.3, generator=torch.Generator().manual_seed(0))

    def forward(self, x, weight=None, runtime_gather_output=None, **_):
        return self.linear(x), None


def tiny_critic(seed: int = 3):
    """A tiny megatron-core GPTModel (qwen3 shapes, tree specs) with a :class:`ValueHead`."""
    from megatron_shims import build_gpt, layer_spec_args, randomize_, tiny_config

    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    cfg = tiny_config("qwen3")
    critic = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    randomize_(critic, seed=seed)
    critic.output_layer = ValueHead(cfg.hidden_size)
    return critic


def add_value_targets(data, seed: int = 8) -> None:
    """``values`` / ``returns`` of a value-loss batch (random, on the response tokens)."""
    gen = torch.Generator().manual_seed(seed)  # independent of test order
    data["values"] = torch.randn(data["responses"].shape, generator=gen) * data["response_mask"]
    data["returns"] = torch.randn(data["responses"].shape, generator=gen) * data["response_mask"]


# ----------------------------------------------------------------------------- row statistics

TOPK = 4
DISTILLATION_KEYS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")


def with_statistics(data, seed: int, distillation: bool = True, k: int = TOPK):
    """``data`` asking for ``sum_pi_squared`` and (``distillation``) top-k distillation: a
    teacher's top-k ids and log-probs per token (``teacher_ids`` / ``teacher_logprobs``
    ``[B, j, k]``, each sample its own, so tokens of a shared row read different ones), and a
    random weight per token (``token_weight``) for :func:`sum_pi_squared_loss`."""
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    offsets = data["input_ids"].offsets()
    n = int(offsets[-1])
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(n)])
    # a teacher's log-probs at those ids: some below the tests' clamp of -5, some above
    logps = torch.log_softmax(2.0 * torch.randn(n, VOCAB, generator=gen), -1).gather(1, ids)
    data["teacher_ids"] = torch.nested.nested_tensor_from_jagged(ids, offsets=offsets)
    data["teacher_logprobs"] = torch.nested.nested_tensor_from_jagged(logps, offsets=offsets)
    data["token_weight"] = torch.nested.nested_tensor_from_jagged(torch.randn(n, generator=gen), offsets=offsets)
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True, distillation_use_topk=distillation)
    return data


def distillation_loss(actor_config, data, clamp: float | None = -5.0, k: int = TOPK):
    """verl's ``distillation_ppo_loss`` (PPO plus forward-KL top-k distillation), as verl's
    workers build it when distillation is on; the engine also calls it as the logits processor.
    ``clamp``: ``log_prob_min_clamp`` (-5 cuts some of the tiny vocab's log-probs, not all).

    verl's distillation term reads ``actor_config.global_batch_info`` before its PPO term sets
    it from the micro-batch, so on a fresh config the first micro-batch is normalised by its own
    tokens (then by the global count): the config is primed with ``data``'s global counts, as
    after verl's first micro-batch, so runs with different micro-batches compare."""
    from functools import partial

    from verl.trainer.distillation.losses import distillation_ppo_loss
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    actor_config.global_batch_info.update(
        dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), global_batch_size=len(data["input_ids"]),
        loss_scale_factor=actor_config.loss_scale_factor,
    )
    loss_config = DistillationLossConfig(loss_mode="forward_kl_topk", topk=k, use_policy_gradient=False,
                                         log_prob_min_clamp=clamp)
    return partial(distillation_ppo_loss, config=actor_config,
                   distillation_config=DistillationConfig(enabled=False, distillation_loss=loss_config))


def sum_pi_squared_loss(loss_fn):
    """``loss_fn`` plus a per-token weighted sum of ``sum_pi_squared`` (weights
    ``token_weight``), so its gradient is checked too (verl's own losses read it without one)."""

    def loss(model_output, data, dp_group=None):
        value, metrics = loss_fn(model_output=model_output, data=data, dp_group=dp_group)
        sq = model_output["sum_pi_squared"].values()
        return value + (sq * data["token_weight"].values().to(sq.device)).sum(), metrics

    return loss
