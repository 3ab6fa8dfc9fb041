"""Hostile inputs to the core API: each gets a clear error naming what is wrong (never a raw
numpy/torch error, a silently truncated value or a plausible wrong number)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps_mcore import plan_prefix_tree, token_logprobs, tree_attention

SEQS = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7]]


def _plan():
    return plan_prefix_tree(SEQS, min_prefix_len=1)


# ----------------------------------------------------------------------------- planner


def test_ragged_nested_sequence_names_its_index():
    with pytest.raises(ValueError, match=r"^sequence 1: could not read it as a 1-D array"):
        plan_prefix_tree([[1, 2, 3], [[1, 2], [3]]])


@pytest.mark.parametrize("seq", [[1, 2, 2**63], [1, 2**64 + 5]])
def test_python_ids_past_int64_say_so(seq):
    with pytest.raises(ValueError, match=r"sequence 0: token ids must be < 2\*\*63.*found " + str(max(seq))):
        plan_prefix_tree([seq])


def test_uint64_ids_past_int64_say_so_not_negative():
    arr = np.array([1, 2**63 + 7], dtype=np.uint64)
    with pytest.raises(ValueError, match=rf"sequence 1: token ids must be < 2\*\*63.*found {2**63 + 7}$"):
        plan_prefix_tree([[3, 4], arr])
    small = np.array([1, 2, 3], dtype=np.uint64)  # uint64 within range still plans
    assert plan_prefix_tree([small, small], min_prefix_len=1).num_tokens == 3


def test_fractional_prompt_lens_are_rejected_not_truncated():
    with pytest.raises(ValueError, match=r"prompt_lens must be integers; prompt_lens\[1\]=2\.5"):
        plan_prefix_tree(SEQS, mode="prompt_only", prompt_lens=[2, 2.5, 1])
    with pytest.raises(ValueError, match=r"prompt_lens must be integers; prompt_lens\[0\]=inf"):
        plan_prefix_tree(SEQS, mode="prompt_only", prompt_lens=np.array([np.inf, 2.0, 1.0]))
    whole = plan_prefix_tree(SEQS, mode="prompt_only", prompt_lens=[3.0, 3.0, 1.0], min_prefix_len=1)
    ints = plan_prefix_tree(SEQS, mode="prompt_only", prompt_lens=[3, 3, 1], min_prefix_len=1)
    assert torch.equal(whole.input_ids, ints.input_ids)


def test_unhashable_group_ids_name_the_entry():
    with pytest.raises(TypeError, match=r"group_ids\[0\] = \[1\] is not hashable"):
        plan_prefix_tree(SEQS, group_ids=[[1], [1], [2]])


@pytest.mark.parametrize("x", [torch.tensor(1.0), torch.zeros(2, 3)])
def test_unpack_of_a_scalar_or_short_tensor_is_a_value_error(x):
    with pytest.raises(ValueError, match=r"unpack expects at least T=\d+ rows"):
        _plan().unpack(x)


# ----------------------------------------------------------------------------- logprobs


def test_token_id_past_the_vocab_is_an_error_not_a_zero_logit():
    plan = _plan()
    logits = torch.randn(plan.num_tokens, 6)  # ids go up to 7
    with pytest.raises(ValueError, match=r"token id 7 is outside the vocab of the logits \(V=6\)"):
        token_logprobs(logits, plan)
    lp, _ = token_logprobs(torch.randn(plan.num_tokens, 8), plan)  # V=8 covers them
    assert lp.shape == (plan.num_input_tokens,) and torch.isfinite(lp).all()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 0.0, -1.0])
def test_temperature_must_be_finite_and_positive(temperature):
    plan = _plan()
    with pytest.raises(ValueError, match="temperature must be a finite positive number"):
        token_logprobs(torch.randn(plan.num_tokens, 8), plan, temperature=temperature)


def test_empty_vocab_is_a_value_error():
    plan = _plan()
    with pytest.raises(ValueError, match="non-empty vocab dimension"):
        token_logprobs(torch.zeros(plan.num_tokens, 0), plan)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 0), (2, 0, 4), (0, 2, 4)])
def test_attention_zero_heads_or_head_dim_is_a_value_error(hq, hkv, d):
    plan = _plan()
    t = plan.num_tokens
    q, k = torch.zeros(t, hq, d), torch.zeros(t, hkv, d)
    with pytest.raises(ValueError, match=r"needs Hq, Hkv and head dim D >= 1"):
        tree_attention(q, k, k.clone(), plan, backend="chunked")
