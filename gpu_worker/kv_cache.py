"""Slot KV cache, preallocated once per model instance.

Each request owns one slot: a row of max_seq_len positions in every layer. A slot's
`lengths[slot]` is its committed length; positions at or beyond it hold nothing that counts.
Writes go to explicit positions (`update`); rollback after rejection is `truncate`, which
only lowers the length; later writes simply overwrite the rejected positions.

Bookkeeping (lengths, which slots are in use) lives on the CPU, so checking a batch and
building its index tensors never waits for the device; `plan` turns it into the few index
tensors a forward needs, copied to the device once per call.
"""

from dataclasses import dataclass

import torch

# Attention windows are whole blocks of KEY_BLOCK keys, the block torch's CPU flash attention
# reduces over, so a block's reductions have one shape wherever a row's keys end
# (model.attention).
KEY_BLOCK = 512


class CacheFullError(RuntimeError):
    """No free slot is left."""


class CacheCapacityError(RuntimeError):
    """A row would grow past max_seq_len."""


class SlotError(ValueError):
    """A slot id that is not allocated, repeated in one batch, or a bad truncate length."""


@dataclass
class ForwardPlan:
    """Index tensors (on the cache's device) for one batched forward; see `KVCache.plan`."""
    write_pos: torch.Tensor          # (B, T) cache column of each token; max_seq_len = scratch
    rope_pos: torch.Tensor           # (B, T) position of each token, clamped to the table
    mask: torch.Tensor               # (B, 1, T, W) bool, True = may attend
    window: int                      # W: keys 0..W-1 of each slot are read
    first_slot: int | None           # slots are first_slot, first_slot+1, ...: read a view


class KVCache:
    """k, v: (L, S, Hkv, max_seq_len + 1, D), zero-initialised.

    Layout: a slot's keys for one layer and head are contiguous in position, so the attention
    window of a slot, `[..., :W, :]`, is one strided slice and the gathered window is already in
    SDPA's (B, Hkv, W, D) layout. The extra last column is a scratch column: writes of padding
    tokens land there, so a forward never needs a data-dependent (device-syncing) selection of
    the valid tokens. Zeros matter: positions in a window that a row must not see are masked,
    but a NaN there would still poison the softmax-weighted sum.
    """

    def __init__(self, config, max_slots: int, max_seq_len: int, device="cpu",
                 dtype=torch.float32):
        if max_slots <= 0 or max_seq_len <= 0:
            raise ValueError(f"max_slots ({max_slots}) and max_seq_len ({max_seq_len}) "
                             f"must be positive")
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        shape = (config.num_layers, max_slots, config.num_kv_heads, max_seq_len + 1,
                 config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(max_slots, dtype=torch.int64)        # (S,) CPU
        self._free = set(range(max_slots))
        self._heads = torch.arange(config.num_kv_heads, device=device).view(1, 1, -1)
        self._arange = torch.arange(max_seq_len + 1, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot, with length 0."""
        if not self._free:
            raise CacheFullError(f"all {self.max_slots} KV cache slots are in use")
        slot = min(self._free)
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def _is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_slots and slot not in self._free

    def free(self, slot: int) -> None:
        if not self._is_allocated(slot):
            raise SlotError(f"slot {slot} is not an allocated slot")
        self._free.add(slot)
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Roll slot back to `length` committed tokens (never grows it)."""
        if not self._is_allocated(slot):
            raise SlotError(f"slot {slot} is not an allocated slot")
        current = int(self.lengths[slot])
        if not 0 <= length <= current:
            raise SlotError(f"truncate slot {slot} to {length}: must be in [0, {current}] "
                            f"(truncate only lowers the committed length)")
        self.lengths[slot] = length

    def plan(self, slots: torch.Tensor, num_new: torch.Tensor, T: int) -> ForwardPlan:
        """Check a batch and build its index tensors on the cache's device.

        slots: (B,) int64; num_new: (B,) int64 in [0, T]. Raises SlotError or
        CacheCapacityError before anything is written. Built from Python lists with one
        tensor creation and one host-to-device copy: at batch 1 the per-call cost of many small
        tensor ops would rival the forward of a small draft model.
        """
        slot_list, new_list = slots.tolist(), num_new.tolist()
        B = len(slot_list)
        if len(set(slot_list)) != B or not all(map(self._is_allocated, slot_list)):
            raise SlotError(f"slots {slot_list} must be distinct allocated slots")
        if not all(0 <= n <= T for n in new_list):
            raise ValueError(f"num_new {new_list} must lie in [0, T={T}]")
        lengths = self.lengths.tolist()
        starts = [lengths[s] for s in slot_list]
        for s, start, n in zip(slot_list, starts, new_list):
            if start + n > self.max_seq_len:
                raise CacheCapacityError(
                    f"slot {s}: committed length {start} + {n} new tokens exceeds "
                    f"max_seq_len {self.max_seq_len}")
        ends = [start + n for start, n in zip(starts, new_list)]
        # Whole key blocks while they fit in the cache's columns (model.forward pads the rest).
        window = min(-(-max(max(ends), 1) // KEY_BLOCK) * KEY_BLOCK, self.max_seq_len + 1)
        last = self.max_seq_len - 1
        write_pos = [[start + t if t < n else self.max_seq_len for t in range(T)]
                     for start, n in zip(starts, new_list)]
        rope_pos = [[min(start + t, last) for t in range(T)] for start in starts]
        index = torch.tensor([write_pos, rope_pos]).to(self.k.device)  # (2, B, T)
        # Always a mask, even where a decode step could attend to everything: one attention path
        # for every step. Padding tokens' clamped positions only change their own outputs.
        mask = (self._arange[:window] <= index[1, :, :, None]).unsqueeze(1)
        contiguous = slot_list == list(range(slot_list[0], slot_list[0] + B))
        return ForwardPlan(write_pos=index[0], rope_pos=index[1], mask=mask, window=window,
                           first_slot=slot_list[0] if contiguous else None)

    def update(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Write k, v (B, T, Hkv, D) of `layer` at cache columns positions (B, T) of slots (B,).

        All on the cache's device. Column max_seq_len is the scratch column for padding.
        """
        index = (slots.view(-1, 1, 1), self._heads, positions.unsqueeze(-1))  # -> (B, T, Hkv)
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def window(self, layer: int, slots: torch.Tensor, plan: ForwardPlan):
        """Keys and values at positions 0..W-1 of slots (B,): two (B, Hkv, W, D) tensors.

        Views when the slots are consecutive (always at batch 1), else gathered copies.
        """
        k, v = self.k[layer, :, :, :plan.window], self.v[layer, :, :, :plan.window]
        if plan.first_slot is not None:
            rows = slice(plan.first_slot, plan.first_slot + slots.shape[0])
            return k[rows], v[rows]
        return k.index_select(0, slots), v.index_select(0, slots)

    def commit(self, slots: torch.Tensor, num_new: torch.Tensor) -> None:
        """Advance lengths[slots] (B,) by num_new (B,) after a forward has written them."""
        self.lengths.index_add_(0, slots.cpu(), num_new.cpu())
