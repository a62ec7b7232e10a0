"""The paper's training experiments, one command each (``griffin experiment``): scaling curves (Section 3.1,
Figure 1a), long-context training (Section 6.1, Figure 5 right) and the local-attention window (Appendix F), on the
runner they share (:mod:`griffin.experiments.runner`)."""

from griffin.experiments.runner import ExperimentError, Grid, Run, run_grid

__all__ = ["ExperimentError", "Grid", "Run", "run_grid"]
