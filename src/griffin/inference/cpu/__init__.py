"""The CPU decode engine (Section 5): a decode step of a 1-3B model at the memory bandwidth of a CPU.

A step reads every weight once, so on CPU it is bound by memory, and its work between the weight matmuls (a few
thousand values per layer) costs more in eager operators than in arithmetic. The engine is applied from outside the
model, as module swaps on a decode copy (:func:`griffin.inference.generate.decode_model`), and every kernel here
mirrors a layer of :mod:`griffin.layers`, against which the tests compare it:

- :mod:`.linear` swaps the linear layers for the matvec kernel (:mod:`.matvec`, its instructions in :mod:`.isa`);
  :mod:`.prepack` for oneDNN's prepacked matmuls;
- :mod:`.fused` swaps the residual blocks for ones whose one-token steps run through the kernels of
  :mod:`.block_step` (the norms, the MLP's GeLU product, the recurrent block between its projections, attention over
  the cache), a whole block or the whole stack in one call and one parallel region whose threads share each phase's
  tasks (:mod:`.tasks`).

Which route a step takes for which batch, dtype and device is tabled in docs/architecture.md ("The CPU decode
engine"). The numba helpers these kernels share with the training kernels live in :mod:`griffin.ops.jit`.
"""
