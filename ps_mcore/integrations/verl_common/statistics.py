"""The LM head's per-token outputs on a tree, as verl's engines return them: ``log_probs``,
``entropy``, ``sum_pi_squared`` (``calculate_sum_pi_squared``) and the top-k distillation
outputs (``distillation_use_topk``).

Every one is a function of a token's predictive distribution, so
:func:`ps_mcore.logprobs.token_statistics` computes the row statistics once per (packed row,
temperature) pair and each sample's tokens read them. Top-k distillation also reads, per token,
the student's log-probs at the teacher's top-k ids (the batch's ``teacher_ids`` /
``teacher_logprobs``, per sample) and the student's own top-k ids; :class:`TopKDistillation`
then evaluates verl's forward-KL top-k loss on those ``[N, K]`` values exactly as verl's FSDP
or Megatron logits processor does (``verl.trainer.distillation.{fsdp,megatron}.losses``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ps_mcore.integrations.verl_common.batch import batch_flag, nested_like
from ps_mcore.logprobs import TokenStatistics


def _distillation_loss_parts(loss_function):
    """``(actor config, distillation config)`` of verl's ``distillation_ppo_loss`` partial, or
    None for any other loss function."""
    try:
        from verl.trainer.distillation.losses import distillation_ppo_loss
    except ImportError:
        return None
    if not isinstance(loss_function, functools.partial) or loss_function.func is not distillation_ppo_loss:
        return None
    keywords = loss_function.keywords
    if "config" not in keywords or "distillation_config" not in keywords:
        return None
    return keywords["config"], keywords["distillation_config"]


@functools.lru_cache(maxsize=None)
def _topk_loss_dispatches(strategy) -> bool:
    """Whether the installed verl's ``compute_topk_loss`` has a top-k loss for ``strategy``
    (0.8.0: fsdp, veomni, megatron; 0.9.1 adds fsdp2); else it raises NotImplementedError,
    before reading its other arguments."""
    from types import SimpleNamespace

    from verl.trainer.distillation.losses import compute_topk_loss

    try:
        compute_topk_loss(SimpleNamespace(strategy=strategy), None, None, None, None)
    except NotImplementedError:
        return False
    except (TypeError, AttributeError):  # it went on to the loss, which failed on the None arguments
        return True
    return True


def topk_distillation_refusal(batch, loss_function) -> str | None:
    """Why a micro-batch's top-k distillation cannot run on the tree (None: it can, or the
    batch asks for none)."""
    if not batch_flag(batch, "distillation_use_topk"):
        return None
    parts = _distillation_loss_parts(loss_function)
    if parts is None:
        return ("distillation_use_topk with a logits processor other than verl's distillation_ppo_loss "
                "is not supported")
    strategy = getattr(parts[0], "strategy", None)
    if not _topk_loss_dispatches(strategy):
        return f"distillation_use_topk under actor strategy {strategy!r} is not supported"
    if "teacher_ids" not in batch.keys() or "teacher_logprobs" not in batch.keys():
        return "distillation_use_topk without the batch's teacher_ids / teacher_logprobs"
    return None


def lm_head_batch_refusal(batch, loss_function=None) -> str | None:
    """Why an LM micro-batch's log-prob request cannot take the tree path (None: it can).
    ``loss_function``: the step's loss, which verl calls as the distillation logits processor."""
    if batch_flag(batch, "distillation_only"):  # verl 0.9.1
        return "distillation_only=True (a distillation-only pass) is not supported"
    return topk_distillation_refusal(batch, loss_function)


@dataclass(frozen=True)
class TopKDistillation:
    """verl's forward-KL top-k distillation of one micro-batch (``compute_forward_kl_topk``).

    Shapes: ``N`` original tokens, ``K`` teacher ids per token.

    Attributes:
        teacher_logprobs: ``[N, K]`` the teacher's top-k log-probs per token (batch order).
        teacher_ids: ``[N, K]`` their token ids.
        clamp: ``log_prob_min_clamp`` (None: no clamp).
        megatron: verl's Megatron formulas (the masses are taken after the clamp, the student's
            masses and the clamp's cut carry no gradient); else its FSDP ones.
    """

    teacher_logprobs: torch.Tensor
    teacher_ids: torch.Tensor
    clamp: float | None
    megatron: bool

    @classmethod
    def of(cls, batch, loss_function) -> "TopKDistillation | None":
        """The micro-batch's distillation (None unless ``distillation_use_topk``); assumes
        :func:`topk_distillation_refusal` passed."""
        if not batch_flag(batch, "distillation_use_topk"):
            return None
        config, distillation_config = _distillation_loss_parts(loss_function)
        return cls(
            batch["teacher_logprobs"].values(),
            batch["teacher_ids"].values(),
            distillation_config.distillation_loss.log_prob_min_clamp,
            config.strategy == "megatron",  # verl's Megatron loss; its FSDP one for the others
        )

    @property
    def topk(self) -> int:
        return self.teacher_ids.size(-1)

    def outputs(self, stats: TokenStatistics) -> dict[str, torch.Tensor]:
        """verl's ``distillation_losses``, ``student_mass``, ``teacher_mass``, ``overlap_count``
        and ``overlap_token_advantage`` ``[N]`` from the student's ``label_logprobs`` at the
        teacher ids and its ``topk_ids``."""
        student = stats.label_logprobs.float()
        teacher = self.teacher_logprobs.to(student.device).float()
        teacher_ids = self.teacher_ids.to(student.device)
        if self.megatron:
            masses = None
        else:  # FSDP: masses before the clamp
            masses = student.exp().sum(-1), teacher.exp().sum(-1)
        if self.clamp is not None:
            teacher = teacher.clamp_min(self.clamp)
            # Megatron's backward passes gradient only where log p > clamp; clamp_min's at >=
            student = torch.where(student > self.clamp, student, self.clamp) if self.megatron else student.clamp_min(self.clamp)
        if masses is None:
            masses = student.detach().exp().sum(-1), teacher.exp().sum(-1)
        token_kl = teacher.exp() * (teacher - student)
        overlap = (teacher_ids.unsqueeze(-1) == stats.topk_ids.unsqueeze(-2)).any(dim=-1)
        count = overlap.sum(dim=-1)
        kl = token_kl.detach() if self.megatron else token_kl  # Megatron marks it non-differentiable
        advantage = (-kl * overlap).sum(dim=-1) / count.clamp_min(1)
        advantage = torch.where(count > 0, advantage, torch.zeros_like(advantage))
        return {
            "distillation_losses": token_kl.sum(-1),
            "student_mass": masses[0],
            "teacher_mass": masses[1],
            "overlap_count": count,
            "overlap_token_advantage": advantage,
        }


@dataclass(frozen=True)
class LMHeadRequest:
    """What verl asks an LM micro-batch's forward to return besides ``log_probs``."""

    entropy: bool = False
    sum_pi_squared: bool = False
    distillation: TopKDistillation | None = None

    @classmethod
    def of(cls, batch, loss_function=None) -> "LMHeadRequest":
        return cls(
            batch_flag(batch, "calculate_entropy"),
            batch_flag(batch, "calculate_sum_pi_squared"),
            TopKDistillation.of(batch, loss_function),
        )

    def statistics_kwargs(self) -> dict:
        """Keyword arguments of :func:`ps_mcore.logprobs.token_statistics` (after its
        temperature and entropy) for this request."""
        kwargs = {"compute_sum_pi_squared": self.sum_pi_squared}
        if self.distillation is not None:
            kwargs.update(label_ids=self.distillation.teacher_ids, topk=self.distillation.topk)
        return kwargs

    def outputs(self, stats: TokenStatistics, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """verl's output dict: every asked-for statistic jagged ``[B, j]`` with ``input_ids``'s
        offsets."""
        result = {"log_probs": stats.logprobs}
        if self.entropy:
            result["entropy"] = stats.entropy
        if self.sum_pi_squared:
            result["sum_pi_squared"] = stats.sum_pi_squared
        if self.distillation is not None:
            result.update(self.distillation.outputs(stats))
        return {name: nested_like(value, input_ids) for name, value in result.items()}
