"""The main job on a user's files: train a model into a run directory, evaluate it, score files with it.

======================  ============================================================================
module                  job
======================  ============================================================================
``card``                the run directory: its layout, the model card (``model.json``), the model
``sources``             training and held-out batches from files (split, epochs, shuffle) or synthetic logs
``fit``                 ``dynemb train``: preprocessing, training, early stopping, checkpoints, metrics
``score``               ``dynemb eval`` and ``dynemb predict``: a trained model over a file
``report``              ``metrics.jsonl`` and the loss/AUC plot
``publish``             serving exports: versions published while training, the best model's export
======================  ============================================================================
"""

from .card import ModelCard, load_model, model_checkpoint, read_card
from .fit import Interrupted, RunSpec, train_run
from .publish import serving_export
from .score import evaluate, evaluate_file, predict_file

__all__ = ["ModelCard", "read_card", "load_model", "model_checkpoint", "RunSpec", "train_run", "Interrupted",
           "evaluate", "evaluate_file", "predict_file", "serving_export"]
