"""Training (Section 3): configuration, the trainer and checkpoints that resume exactly; a :class:`StopRequest`
ends a run early with a checkpoint (``train(cfg, stop=...)``; SIGTERM in ``griffin train``)."""

from griffin.training.config import TrainConfig
from griffin.training.source import BatchSource
from griffin.training.trainer import StopRequest, Trainer, TrainingError, TrainingStopped, TrainResult, train

__all__ = ["BatchSource", "StopRequest", "TrainConfig", "TrainResult", "Trainer", "TrainingError", "TrainingStopped",
           "train"]
