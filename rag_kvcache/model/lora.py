"""A LoRA link calibration: low-rank updates of the attention projections that teach the model
to read chunks encoded alone (Block-Attention's fine-tune, as an adapter), and its file.

Link tokens (`link.calibration`) add a few tokens the question can read and leave the model
and its cached KV as they are. An adapter instead changes the model: trained by
`rag-kvcache calibrate --kind lora` (`tools/calibrate.py`, whose student is
`link.block_attention.block_logits`) so that a prompt whose document chunks attend only within
themselves, what a naive link computes, gives a plain prefill's next-token distributions.

Loaded with the model (`ModelConfig.lora`), it is merged into the weights: the adapted model
answers every request, prefill included, at the base model's speed, and has a fingerprint of
its own, so the KV it links is its own (a new adapter re-encodes; the base model's chunks are
never mixed in). An adapter of zero updates is the base model (tested). peft injects, saves
and merges the low-rank layers; what is ours is the file: safetensors, never pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rag_kvcache.errors import CalibrationError
from rag_kvcache.model.calibration_file import metadata, read_checked, write_atomically

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention's projections


@dataclass(frozen=True)
class LinkLoRA:
    """A trained adapter: peft's tensors by name, its shape, and what it was trained on."""

    tensors: dict[str, torch.Tensor]  # peft's state dict (lora_A / lora_B per target layer)
    rank: int
    alpha: int
    targets: tuple[str, ...]
    base_fingerprint: str  # the model it adapts (LoadedModel.fingerprint before merging)
    trained_with: str  # the strategy spelling it was trained under (informative)
    steps: int = 0
    loss: float = float("nan")  # last mean KL to prefill on the training items

    def to_bytes(self) -> bytes:
        """safetensors bytes: the tensors, the rest as string metadata (never pickled)."""
        meta = {
            "kind": "lora",
            "rank": str(self.rank),
            "alpha": str(self.alpha),
            "targets": json.dumps(list(self.targets)),
            "base_fingerprint": self.base_fingerprint,
            "trained_with": self.trained_with,
            "steps": str(self.steps),
            "loss": repr(self.loss),
        }
        tensors = {k: v.detach().float().contiguous() for k, v in self.tensors.items()}
        return save_safetensors(tensors, meta)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "adapter") -> LinkLoRA:
        """Inverse of to_bytes; a clear CalibrationError for anything else."""
        try:
            tensors = load_safetensors(data)
            meta = metadata(data)
            if meta.get("kind") != "lora":
                raise ValueError("not a LoRA adapter (no kind=lora)")
            lora = cls(
                tensors,
                int(meta["rank"]),
                int(float(meta["alpha"])),
                tuple(json.loads(meta["targets"])),
                meta["base_fingerprint"],
                meta["trained_with"],
                int(meta["steps"]),
                float(meta["loss"]),
            )
        except (SafetensorError, KeyError, ValueError, TypeError, AttributeError) as e:
            raise CalibrationError(f"{where} is not a LoRA adapter file: {e}") from None
        if lora.rank < 1 or not lora.targets or not set(lora.targets) <= set(TARGETS):
            raise CalibrationError(f"{where}: rank {lora.rank}, targets {lora.targets} not valid")
        return lora

    def save(self, path: Path) -> str:
        """Write atomically to `path`; returns the sha256 of the bytes written."""
        return write_atomically(path, self.to_bytes())

    @classmethod
    def load(cls, path: Path) -> LinkLoRA:
        return cls.from_bytes(read_checked(path, "LoRA adapter"), str(path))


def _config(rank: int, alpha: int, targets: tuple[str, ...]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)


def add_lora(
    model: Any, rank: int, alpha: int, targets: tuple[str, ...] = TARGETS
) -> dict[str, torch.nn.Parameter]:
    """Inject fresh low-rank layers into `model` in place (B = 0: still the base model) and
    return their parameters by name, the only ones that train."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(_config(rank, alpha, targets), model)
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def lora_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The injected layers' tensors by name (peft's state dict), detached copies."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def remove_lora(model: Any, merge: bool) -> None:
    """Take the injected layers out of `model`: folded into the base weights (`merge`), or
    dropped (the base model back, e.g. after training)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            if merge:
                module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    if hasattr(model, "peft_config"):  # what peft set on the model beside the layers
        del model.peft_config


def merge_lora(model: Any, lora: LinkLoRA, fingerprint: str) -> None:
    """Fold `lora` into `model`'s weights; `fingerprint` is the model's before (checked
    against the adapter's, a CalibrationError for another model)."""
    from peft import set_peft_model_state_dict

    if lora.base_fingerprint != fingerprint:
        raise CalibrationError(
            f"the LoRA adapter was trained on model {lora.base_fingerprint}, not on the loaded "
            f"{fingerprint} (a fingerprint covers the weights and their dtype); run "
            "`rag-kvcache calibrate --kind lora` for it"
        )
    add_lora(model, lora.rank, lora.alpha, lora.targets)
    try:
        result: Any = set_peft_model_state_dict(model, lora.tensors)
    except (RuntimeError, ValueError, KeyError) as e:  # e.g. tensors of another rank
        remove_lora(model, merge=False)
        raise CalibrationError(f"the LoRA adapter does not fit the model: {e}") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        remove_lora(model, merge=False)
        raise CalibrationError(
            f"the LoRA adapter does not fit the model: missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}"
        )
    with torch.no_grad():
        remove_lora(model, merge=True)
