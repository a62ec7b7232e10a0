"""``python -m griffin.evaluation [lm_eval arguments]``: lm-evaluation-harness' own command line with the ``griffin``
model registered, for harness versions that do not discover plugins (``lm_eval --model griffin`` then works as
``python -m griffin.evaluation --model griffin ...``)."""

import griffin.threads

griffin.threads.prefer_passive_openmp_wait()  # as the griffin command does, before lm_eval imports torch

from lm_eval.__main__ import cli_evaluate  # noqa: E402

import griffin.evaluation.harness  # noqa: E402, F401  (registers the griffin model)

if __name__ == "__main__":
    cli_evaluate()
