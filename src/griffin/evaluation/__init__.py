"""Evaluation (Sections 3.2, 6.1, 6.2): held-out loss streamed far past the training length (per position,
Figure 5), the paper's downstream tasks through lm-evaluation-harness offline, and phonebook lookup.

The harness pieces (:mod:`griffin.evaluation.harness`: the ``griffin`` lm-eval model, ``evaluate_tasks``) need the
``eval`` extra (``pip install 'griffin[eval]'``) and are imported from their module, not from here.
"""

from griffin.evaluation.loading import load_for_eval
from griffin.evaluation.loss import (
    LossResult,
    PerPositionResult,
    evaluate_loss,
    per_position_loss,
    reference_token_losses,
    token_losses,
)
from griffin.evaluation.phonebook import PhonebookResult, evaluate_phonebook, make_example

__all__ = ["LossResult", "PerPositionResult", "PhonebookResult", "evaluate_loss", "evaluate_phonebook",
           "load_for_eval", "make_example", "per_position_loss", "reference_token_losses", "token_losses"]
