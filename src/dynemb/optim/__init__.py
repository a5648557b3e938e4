"""Sparse optimizers whose state lives in the table's slot rows."""

from .algorithms import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad
from .base import SparseOptimizer
from .combined import CombinedOptimizer
from .wrapper import OptimizerWrapper

__all__ = ["SparseOptimizer", "CombinedOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL",
           "OptimizerWrapper"]
