"""Evaluation metrics over whole tensors."""

from __future__ import annotations

import warnings

import torch

__all__ = ["auc", "held_out_auc"]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve, by ranks (Mann-Whitney U); tied scores share their average rank.

    Args:
        scores: any real scores (logits or probabilities); higher means more likely positive.
        labels: 0/1 labels (any numeric or bool dtype), same shape as ``scores``.

    Returns:
        The probability that a random positive scores above a random negative, ties counting one half.

    Raises:
        TypeError: ``scores`` or ``labels`` is not a tensor.
        ValueError: shapes differ, or the labels are not all 0/1 or hold only one class.

    Shape:
        ``scores``, ``labels``: any shape ``S``, flattened.

    Example:
        >>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        0.75
    """
    for name, t in (("scores", scores), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if scores.shape != labels.shape:
        raise ValueError(
            f"scores and labels must have the same shape, got {tuple(scores.shape)} and {tuple(labels.shape)}"
        )
    y = labels.reshape(-1).double()
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("labels must hold only 0/1 values")
    n_pos = float(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC needs both classes, got {int(n_pos)} positives and {int(n_neg)} negatives")
    sorted_scores, order = torch.sort(scores.reshape(-1).double())
    _, group, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1.0) / 2.0  # 1-based ranks start..end of a tie group, averaged
    pos_rank_sum = float((mean_rank[group] * y[order]).sum())
    return (pos_rank_sum - n_pos * (n_pos + 1.0) / 2.0) / (n_pos * n_neg)


def held_out_auc(scores: torch.Tensor, labels: torch.Tensor, where: str = "the held-out rows") -> float:
    """:func:`auc`, or NaN (which the ``dynemb`` commands print as ``null``) with a
    :class:`~dynemb.data.preprocess.DataWarning` when ``labels`` hold one class only, as a small held-out set of
    rare positives can: the log loss still measures the model, and training goes on.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     held_out_auc(torch.tensor([0.2, 0.7]), torch.tensor([0, 0]))
        nan
        >>> str(caught[0].message)
        'the held-out rows hold one class only (2 negatives, 0 positives): AUC is undefined (null)'
    """
    y = labels.reshape(-1)
    positives = int((y == 1).sum())
    if 0 < positives < y.numel():
        return auc(scores, labels)
    from .preprocess import DataWarning

    warnings.warn(f"{where} hold one class only ({y.numel() - positives:,} negatives, {positives:,} positives): "
                  "AUC is undefined (null)", DataWarning, stacklevel=2)
    return float("nan")
