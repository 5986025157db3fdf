"""The preference losses ``dpo.loss`` chooses between, each from its paper's formula.

All take per-pair tensors of response log-probabilities summed over the response tokens
(``policy_*`` from the model being trained, ``ref_*`` from the frozen reference) and
return per-pair ``(loss, chosen reward, rejected reward)``. With

    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)),

the log-ratio margin, the reward of a response is DPO's implicit one, ``beta * (log pi -
log ref)``, for every loss that has a reference (so ``reward_margin`` is ``beta * h``
whichever of them trains); SimPO has no reference, and its rewards are its own
length-normalised ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta * h)``, ``dpo.loss: sigmoid``.

    Per-pair (loss, chosen reward, rejected reward), rewards = beta * (log pi - log ref).
    """
    reward_chosen = beta * (policy_chosen - ref_chosen)
    reward_rejected = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(reward_chosen - reward_rejected), reward_chosen, reward_rejected


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
    Human Preferences", its tau our beta): ``(h - 1 / (2 beta))^2``.

    A squared loss with its minimum at the margin ``h = 1/(2 beta)``, so unlike DPO's it
    stops pushing a pair once its margin is there (no drift to infinite margins on pairs
    that are already separated). ``h`` uses the summed response log-probabilities, as
    the paper writes it and as DPO here does; TRL's ``loss_type="ipo"`` averages them per
    token instead, so its ``beta`` is not ours.
    """
    reward_chosen = beta * (policy_chosen - ref_chosen)
    reward_rejected = beta * (policy_rejected - ref_rejected)
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return (margin - 1 / (2 * beta)) ** 2, reward_chosen, reward_rejected


def dpop_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
              ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
              lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO-Positive (Pal et al. 2024, "Smaug: Fixing Failure Modes of Preference
    Optimisation with DPO-Positive"):
    ``-log sigmoid(beta * (h - lam * max(0, log ref(y_w|x) - log pi(y_w|x))))``.

    DPO can raise the margin while lowering the chosen answer's own likelihood (a
    rejected answer that falls faster); the penalty acts only when the chosen answer's
    log-prob is below the reference's. ``lam`` is ``dpo.dpop_lambda`` (the paper: 50).
    """
    reward_chosen = beta * (policy_chosen - ref_chosen)
    reward_rejected = beta * (policy_rejected - ref_rejected)
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    penalty = lam * torch.clamp(ref_chosen - policy_chosen, min=0)
    return -F.logsigmoid(beta * (margin - penalty)), reward_chosen, reward_rejected


def simpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
               len_chosen: torch.Tensor, len_rejected: torch.Tensor, beta: float,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward"):
    ``-log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)``.

    No reference model: a response's reward is ``beta`` times its mean log-prob per
    token (``len_*``: response tokens), the quantity greedy decoding favours, and
    ``gamma`` (``dpo.simpo_gamma``) is the target margin between them. The paper's
    ``beta`` is 2-2.5, not DPO's 0.1: the rewards here are per token.
    """
    reward_chosen = beta * policy_chosen / len_chosen
    reward_rejected = beta * policy_rejected / len_rejected
    return (-F.logsigmoid(reward_chosen - reward_rejected - gamma), reward_chosen,
            reward_rejected)
