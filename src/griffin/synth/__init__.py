"""Copy and retrieval tasks trained from scratch (Section 6.2, Figure 6a/b, Appendix H): selective copying,
induction heads and Zoology's MQAR; ``griffin synth``."""

from griffin.synth.evaluate import evaluate_lengths, load_run, score
from griffin.synth.source import TaskSource
from griffin.synth.tasks import MQAR, TASKS, InductionHeads, SelectiveCopying, Task, make_task, task_from_dict
from griffin.synth.train import SynthResult, train_task

__all__ = ["MQAR", "TASKS", "InductionHeads", "SelectiveCopying", "SynthResult", "Task", "TaskSource",
           "evaluate_lengths", "load_run", "make_task", "score", "task_from_dict", "train_task"]
