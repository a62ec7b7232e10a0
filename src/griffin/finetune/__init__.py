"""Fine-tuning released checkpoints (docs/finetuning.md): LoRA adapters trained with ``peft`` on a frozen model
(:mod:`griffin.finetune.lora`; their files: :mod:`griffin.interop.adapters`) and the held-out replies scored during
training (:mod:`griffin.finetune.evaluate`). The examples and their loss mask: :mod:`griffin.data.examples`; the
loop is ``griffin train``'s, started from a checkpoint (``--init``; ``griffin finetune``)."""

from griffin.finetune.lora import apply_lora, lora_layers, merge_lora, save_lora

__all__ = ["apply_lora", "lora_layers", "merge_lora", "save_lora"]
