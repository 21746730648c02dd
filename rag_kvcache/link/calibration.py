"""Per-model link calibration: a few trained link tokens after every document chunk.

A chunk encoded alone never saw the chunks it is linked with, and on a small model the
question then reads distractors' stale KV as if it were the answer's. A calibration is K soft
tokens (input embeddings, the model frozen: KVLink's link tokens, KV Packet's adapters)
placed after every document chunk and computed at link time with the question, attending to
every chunk before them: the only tokens of the context that see across chunks, trained
(`tools/calibrate.py`) so that the question, reading through them, gets prefill's next-token
distributions back.

Being computed at link time, link tokens leave the cached KV as it is: a new calibration
needs no re-encoding. What ties a calibration to the KV is the model (its fingerprint) and
the encode settings it was trained with (sink tokens); `check_compatible` refuses others.
A calibration of zero link tokens is linking without one (tested).

`with_link_slots` is the whole of what the linker does differently: the chunk list gains a
placeholder chunk of K slots after every document chunk, which the link's forward computes
from the calibration's vectors instead of token embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rag_kvcache.errors import CalibrationError
from rag_kvcache.kv import ChunkKV, EncodeSettings
from rag_kvcache.model.adapter import embed, embedding_width
from rag_kvcache.model.calibration_file import metadata, read_checked, write_atomically
from rag_kvcache.model.loading import LoadedModel

LINK_SLOT = "link-slot"  # cache ID of the placeholder chunks (never stored)


@dataclass(frozen=True)
class Calibration:
    """K trained link-token embeddings for one model, and what they were trained with."""

    vectors: torch.Tensor  # [K, hidden] input embeddings, float32
    fingerprint: str  # the model's (LoadedModel.fingerprint)
    encode: str  # EncodeSettings.key() of the document chunks it was trained on
    trained_with: str  # the strategy spelling it was trained under (informative)
    steps: int = 0  # optimisation steps taken
    loss: float = float("nan")  # last mean KL to prefill on the training items

    def __post_init__(self) -> None:
        # NaN vectors (a diverged training, a damaged file) would answer empty, silently
        if not bool(torch.isfinite(self.vectors.detach()).all()):
            raise CalibrationError(
                "the calibration's vectors are not finite (NaN or inf): its training diverged "
                "or its file is damaged; train again (a lower --lr)"
            )

    @property
    def link_tokens(self) -> int:
        return int(self.vectors.shape[0])

    def to(self, lm: LoadedModel) -> Calibration:
        """The same calibration with its vectors on the model's device, in its dtype."""
        return replace(self, vectors=self.vectors.to(lm.device, lm.dtype))

    def to_bytes(self) -> bytes:
        """safetensors bytes: the vectors, the rest as string metadata (never pickled)."""
        meta = {
            "fingerprint": self.fingerprint,
            "encode": self.encode,
            "trained_with": self.trained_with,
            "steps": str(self.steps),
            "loss": repr(self.loss),
        }
        return save_safetensors({"vectors": self.vectors.detach().float().contiguous()}, meta)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "calibration") -> Calibration:
        """Inverse of to_bytes; a clear CalibrationError for anything else."""
        meta: dict[str, str] = {}
        try:
            tensors = load_safetensors(data)
            meta = metadata(data)
            vectors = tensors["vectors"]
            return cls(
                vectors,
                meta["fingerprint"],
                meta["encode"],
                meta["trained_with"],
                int(meta["steps"]),
                float(meta["loss"]),
            )
        except (SafetensorError, KeyError, ValueError, TypeError, AttributeError) as e:
            if isinstance(e, KeyError) and {"config", "step"} <= set(meta):
                raise CalibrationError(
                    f"{where} is a `rag-kvcache calibrate` checkpoint, not a calibration: "
                    "give the calibration.safetensors beside it"
                ) from None
            why = f"it holds no {e}" if isinstance(e, KeyError) else str(e)
            raise CalibrationError(f"{where} is not a calibration file ({why})") from None

    def save(self, path: Path) -> str:
        """Write atomically to `path`; returns the sha256 of the bytes written."""
        return write_atomically(path, self.to_bytes())

    @classmethod
    def load(cls, path: Path, checksum: str | None = None) -> Calibration:
        """Read `path`; with `checksum`, a mismatch is a CalibrationError (a damaged file)."""
        return cls.from_bytes(read_checked(path, "calibration", checksum), str(path))

    def check_compatible(self, lm: LoadedModel, chunks: list[ChunkKV]) -> None:
        """Clear errors for a calibration used with another model or other chunk encoding."""
        if self.fingerprint != lm.fingerprint:
            raise CalibrationError(
                f"the calibration was trained on model {self.fingerprint}, not on the loaded "
                f"{lm.fingerprint} ({lm.name}, {lm.dtype}); run `rag-kvcache calibrate` for it"
            )
        width = embedding_width(lm)
        if self.vectors.ndim != 2 or self.vectors.shape[1] != width:
            raise CalibrationError(
                f"calibration vectors {tuple(self.vectors.shape)} do not fit the model's "
                f"embeddings of width {width}"
            )
        for c in chunks[1:]:
            if EncodeSettings(c.sink_ids).key() != self.encode:
                raise CalibrationError(
                    f"chunk {c.cache_id} was encoded with {EncodeSettings(c.sink_ids).key()!r}; "
                    f"the calibration was trained on chunks encoded with {self.encode!r}"
                )


@dataclass(frozen=True)
class LinkSlots:
    """Where the link tokens go once `with_link_slots` has laid the chunks out."""

    chunks: list[ChunkKV]  # the chunks, a placeholder of K slots after every document chunk
    link_tokens: int  # K
    positions: torch.Tensor  # [S] the slots' positions (sorted)
    vector_index: torch.Tensor  # [S] which calibration vector each slot takes

    def moved(self, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Positions in the chunks without slots ([R], chunk lengths `lengths`) -> the same
        tokens' positions with the slots in place (each document after its predecessors')."""
        shift = torch.tensor([self.link_tokens * max(i - 1, 0) for i in range(len(lengths))])
        per_token = torch.repeat_interleave(shift, torch.tensor(lengths)).to(positions.device)
        return positions + per_token[positions]

    def computed(self, recompute: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The positions a link computes [R + S] (sorted): the strategy's recomputed tokens
        (`recompute`, positions in the chunks without slots) moved, and every slot."""
        return torch.cat((self.moved(recompute, lengths), self.positions)).sort().values


def soft_inputs(
    lm: LoadedModel,
    new_ids: torch.Tensor,
    new_positions: torch.Tensor,
    slots: LinkSlots,
    vectors: torch.Tensor,
) -> torch.Tensor:
    """Input embeddings [1, N, width] of the link's new tokens (ids and positions [N]): the
    model's own, but a link slot's row is its calibration vector (differentiable in
    `vectors`, for training)."""
    inputs = embed(lm, new_ids[None]).clone()
    is_slot = torch.isin(new_positions, slots.positions)
    which = torch.searchsorted(slots.positions, new_positions[is_slot])
    inputs[0, is_slot] = vectors[slots.vector_index[which]].to(inputs.dtype)
    return inputs


def with_link_slots(lm: LoadedModel, chunks: list[ChunkKV], link_tokens: int) -> LinkSlots:
    """The chunks (chunk 0, the system prefix, first) with a placeholder chunk of
    `link_tokens` slots after every document chunk: zero KV (the link's forward writes the
    link tokens' fresh K/V over it) and token id 0 (their inputs come from the calibration)."""
    laid: list[ChunkKV] = [chunks[0]]
    shape = (lm.num_layers, lm.num_kv_heads, link_tokens, lm.head_dim)
    blank = torch.zeros(shape, dtype=lm.dtype, device=chunks[0].keys.device)
    placeholder = ChunkKV(LINK_SLOT, lm.fingerprint, (0,) * link_tokens, blank, blank)
    slots: list[int] = []
    at = chunks[0].num_tokens
    for c in chunks[1:]:
        laid += [c, placeholder] if link_tokens else [c]
        at += c.num_tokens
        slots += range(at, at + link_tokens)
        at += link_tokens
    documents = len(chunks) - 1
    return LinkSlots(
        laid,
        link_tokens,
        torch.tensor(slots, dtype=torch.long, device=lm.device),
        torch.arange(link_tokens, device=lm.device).repeat(documents),
    )
