"""Many LoRA adapters served by one engine, mixed in one batch (docs/lora.md): PEFT loading
(peft.py), the adapted linears and their slots (layers.py), the batched kernels (kernels.py,
triton_ops.py) and which adapters hold the slots (manager.py)."""
