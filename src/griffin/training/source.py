"""Batches from somewhere other than a prepared dataset: the trainer's extension point (Section 3's loop, any data).

By default :class:`griffin.training.Trainer` reads a dataset prepared by ``griffin prepare``. Given a
``BatchSource`` instead (``Trainer(cfg, source=...)``), it draws its training batches from the source, evaluates
through the source's own held-out metrics, and saves the source's position in every checkpoint, so that a run
resumes exactly; everything else (AdamW, schedule, clipping, checkpoints, logs, TensorBoard) is unchanged. The
synthetic tasks of Section 6.2 (:mod:`griffin.synth`) train this way.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from griffin.data import Batch
from griffin.model import CausalLM


@runtime_checkable
class BatchSource(Protocol):
    """An endless, resumable stream of training batches with its own held-out evaluation.

    Attributes:
        vocab_size: the tokens the model must cover (the model's vocab_size follows it unless set explicitly).
        description: one line naming the data, printed in the run's header and stored in checkpoints.
        baseline_loss: the loss per target of predicting the targets' marginal frequencies (printed and plotted
            beside the validation loss, like the unigram loss of a text dataset).

    Optional: ``whole_rows = True`` says that every row of every batch is one document from position 0 (positions
    0, 1, ..., seq_len - 1; nothing packed or padded). The trainer then gives the model no positions, so attention
    needs no document mask (the compiled step runs faster), and refuses a batch whose positions say otherwise.
    """

    vocab_size: int
    description: str
    baseline_loss: float

    def __next__(self) -> Batch:
        """The next batch: input ids, positions and targets (-100: no loss), each (batch, seq_len)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The source's position, JSON-serialisable (saved in every checkpoint)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``: the next batches are those the saved source would have produced."""
        ...

    def evaluate(self, model: CausalLM) -> dict[str, float]:
        """Metrics of ``model`` (in eval mode, gradients off) on the held-out data; ``val_loss``, the mean loss per
        target, among them (checkpoints keep the best by it)."""
        ...
