"""``python -m griffin.evaluation [lm_eval arguments]``: lm-evaluation-harness' own command line with the ``griffin``
model registered, for harness versions that do not discover plugins (``lm_eval --model griffin`` then works as
``python -m griffin.evaluation --model griffin ...``)."""

from lm_eval.__main__ import cli_evaluate

import griffin.evaluation.harness  # noqa: F401  (registers the griffin model)

if __name__ == "__main__":
    cli_evaluate()
