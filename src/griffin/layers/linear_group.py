"""Layers that read the same input, applied as one module: the seam where a decode step fuses them (Section 5).

Attention's query, key and value projections, the recurrent block's two branches and the MLP's two up-projections
each read one input. :class:`LinearGroup` applies such layers to it and returns their outputs in order; the block
calls the group rather than each layer, so that code outside the model (the decoder's module swaps,
:mod:`griffin.inference.cpu.linear`) can replace the group by one matmul over all the layers' weights.
"""

from __future__ import annotations

from torch import Tensor, nn


class LinearGroup(nn.Module):
    """``group(x)`` = (owner.<name>(x) for each name), a tuple. The layers stay the owner's children: the group
    refers to them by name and registers nothing, so parameter and state-dict names are the owner's, and a layer
    replaced on the owner (a module swap) is the one the group calls."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = tuple(names)
        self.owner = [owner]  # a list, so that the owner is not registered as this module's child (a cycle)

    def layers(self) -> list[nn.Module]:
        """The layers, in order, as the owner holds them now."""
        return [getattr(self.owner[0], name) for name in self.names]

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(layer(x) for layer in self.layers())

    def extra_repr(self) -> str:
        return ", ".join(self.names)
