"""Helpers of the LoRA tests: PEFT adapters written in PEFT's file layout."""

from __future__ import annotations
from pathlib import Path
from typing import Any


def make_adapter(base: Path, out: Path, seed: int, **config: Any) -> Path:
    """A PEFT LoRA adapter on ``base`` with random (non-zero) factors, saved as PEFT saves."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base)
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **config})
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.02)
    peft_model.save_pretrained(out)
    return out


TARGETS = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
