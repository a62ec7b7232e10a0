"""Training (Section 3): configuration, the trainer and checkpoints that resume exactly."""

from griffin.training.config import TrainConfig
from griffin.training.source import BatchSource
from griffin.training.trainer import Trainer, TrainingError, TrainResult, train

__all__ = ["BatchSource", "TrainConfig", "TrainResult", "Trainer", "TrainingError", "train"]
