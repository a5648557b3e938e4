"""The main job on a user's files: train a model into a run directory, evaluate it, score files with it.

======================  ============================================================================
module                  job
======================  ============================================================================
``card``                the run directory: its layout, the model card (``model.json``), the model
``sources``             training and held-out batches from files (split, epochs, shuffle) or synthetic logs
``fit``                 ``dynemb train``: preprocessing, training, checkpoints, metrics, the final line
``score``               ``dynemb eval`` and ``dynemb predict``: a trained model over a file
``report``              ``metrics.jsonl`` and the loss/AUC plot
======================  ============================================================================
"""

from .card import ModelCard, load_model, read_card
from .fit import RunSpec, train_run
from .score import evaluate, evaluate_file, predict_file

__all__ = ["ModelCard", "read_card", "load_model", "RunSpec", "train_run", "evaluate", "evaluate_file",
           "predict_file"]
