"""Slot KV cache, filled on demand within a memory budget.

Each request owns one slot. A slot's storage is its own pair of tensors, grown in whole blocks of
SLOT_BLOCK positions as the slot's tokens need them (`reserve`, or `plan` as a fallback) and
released when the slot is freed, so an idle process holds no KV memory and a short request holds
one block, not max_seq_len positions. The sum over slots never exceeds `memory_bytes`:
`allocate(length)` is admission (the new slot's blocks must fit and leave ADMISSION_HEADROOM of
the budget for running slots to grow), `reserve` is growth (any free budget); both raise
CacheMemoryError, changing nothing, when the memory is short. Callers turn that into an
`overloaded` answer (gpu_worker/verifier/verifier_core.py) or a step without drafts
(gpu_worker/drafter/drafter_core.py); nothing crashes.

Why per-slot tensors grown by copying, not a pool of blocks with a block table: attention reads a
slot's window as one strided tensor, so at batch 1 (the CPU serving case) the window is a view
of the slot's storage, with no gather per layer, exactly as in a preallocated cache; a block
pool would gather the window's blocks into one tensor per layer per step. Growth copies the
slot's blocks once per new block (a 2048-token request: 1 + 2 + 3 blocks copied in its life).
A batch of several slots gathers their windows into one tensor per layer (as the old
preallocated cache did for non-consecutive slots).

A reclaimer (`KVCache.reclaimer`, gpu_worker/batching/prefix_cache.py) may hold storage that a freed
slot leaves (`detach`): its bytes stay charged to the budget until it hands them back
(`release_bytes`), and admission and growth ask it to give up what they lack (`reclaim`) before
they refuse; heartbeats count what it holds as free (`num_admissible`).

`lengths[slot]` is a slot's committed length; positions at or beyond it hold nothing that
counts. Writes go to explicit positions (`update`); rollback after rejection is `truncate`,
which only lowers the length (storage is kept: the next step overwrites the rejected
positions). Bookkeeping (lengths, storage, free slots) lives on the CPU, so checking a batch and
building its index tensors never waits for the device; `plan` turns it into the few index
tensors a forward needs, copied to the device once per call.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_worker.runtime.kernel_paths import fixed_kernel

# Attention windows are whole blocks of KEY_BLOCK keys: model.attention reduces each block with
# one shape wherever a row's keys end and combines the blocks in a fixed order. Much less than the
# 512 of torch's CPU flash kernel's own split (its fallback), so a short context reads fewer padding keys; not
# 64 or 128, because at one token a step costs more per block combined (a few small ops per
# layer) than per padding key read (ops/bench/RESULTS.md, Batch-invariant forward: the key block).
KEY_BLOCK = 256
# Slots grow by SLOT_BLOCK positions at a time: a multiple of KEY_BLOCK, so a window of whole key
# blocks is always within the storage of the slot that reaches furthest. Larger than KEY_BLOCK so
# a long request copies its storage less often (every growth copies what the slot holds).
SLOT_BLOCK = 512
assert SLOT_BLOCK % KEY_BLOCK == 0
# Admission leaves this share of a budget free for running slots to grow (vLLM's admission
# watermark, larger here because a slot grows a whole SLOT_BLOCK at a time).
ADMISSION_HEADROOM = 0.1


class CacheFullError(RuntimeError):
    """No free slot is left."""


class CacheMemoryError(RuntimeError):
    """The memory budget cannot hold the blocks a slot needs."""


class CacheCapacityError(RuntimeError):
    """A row would grow past max_seq_len."""


class SlotError(ValueError):
    """A slot id that is not allocated, repeated in one batch, or a bad truncate length."""


@dataclass
class WindowGroup:
    """Rows of one forward that attend over one window of keys 0..W-1 (whole KEY_BLOCKs): the
    rows whose own windows have the same power-of-two bound on their blocks, so a short row next
    to a long one neither reads nor attends over the long one's keys (`KVCache.plan`)."""
    rows: torch.Tensor | None        # (Bg,) int64 the group's rows of the batch; None: all, in order
    window: int                      # W: keys 0..W-1 of each of its slots are read
    keys: list[tuple[torch.Tensor, ...]]    # per row of the group, its slot's storage per layer
    values: list[tuple[torch.Tensor, ...]]
    views: list[tuple[torch.Tensor, torch.Tensor]] | None  # a group of one row: each layer's
                                     # window, (1, Hkv, W, D) views of its slot's storage


@dataclass
class ForwardPlan:
    """Index tensors (on the cache's device) for one batched forward; see `KVCache.plan`."""
    write_pos: torch.Tensor          # (B, T) column of each token; a slot's last column = scratch
    rope_pos: torch.Tensor           # (B, T) position of each token, clamped to the table; a
                                     # token attends to the keys at positions <= its rope_pos
    keys: list[tuple[torch.Tensor, ...]]    # per row, its slot's storage per layer: (Hkv, C + 1, D)
    values: list[tuple[torch.Tensor, ...]]
    write_columns: list[torch.Tensor]  # per row, its write_pos (T,)
    groups: list[WindowGroup]        # the rows by window, each row in one


class Reclaimer(Protocol):
    """Holds storage detached from freed slots, charged to the budget, and gives it up on demand."""

    @property
    def evictable_bytes(self) -> int: ...

    def reclaim(self, nbytes: int) -> None:
        """Hand back (`release_bytes`) at least nbytes, or all it holds."""


class KVCache:
    """Slot s holds k, v: (L, Hkv, C_s + 1, D) each, zero-initialised, where the capacity C_s is
    a whole number of SLOT_BLOCKs covering the slot's tokens, at most max_seq_len rounded up to
    whole KEY_BLOCKs (`capacity_for`).

    Layout: a slot's keys for one layer and head are contiguous in position, so its attention
    window `[layer, :, :W]` is one strided slice in the (Hkv, W, D) layout attention reads, and
    W, whole KEY_BLOCKs, never passes the storage of the slot that reaches furthest. The
    extra last column is a scratch column: writes of padding tokens land there, so a forward
    never needs a data-dependent (device-syncing) selection of the valid tokens. Zeros matter:
    positions in a window that a row must not see are masked, but a NaN there would still
    poison the softmax-weighted sum (rolled-back positions hold finite stale values).

    memory_bytes: the budget for all slots' storage; None = enough for every slot at
    max_seq_len (growth then never runs short, and admission keeps no headroom).
    side_bytes_per_token: bytes the owner keeps per position of a slot beside its keys and
    values (the verifier's feature rows), charged to the budget with them: the owner sizes that
    storage by `capacity_for`, so a slot's capacity pays for both.
    """

    def __init__(self, config, max_slots: int, max_seq_len: int, device="cpu",
                 dtype=torch.float32, memory_bytes: int | None = None, side_bytes_per_token: int = 0):
        if max_slots <= 0 or max_seq_len <= 0:
            raise ValueError(f"max_slots ({max_slots}) and max_seq_len ({max_seq_len}) "
                             f"must be positive")
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        self.dtype = dtype
        self._dims = (config.num_layers, config.num_kv_heads, config.head_dim)
        # bytes of one position of one slot: keys and values of every layer, and the owner's side rows
        self.bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * \
            torch.empty((), dtype=dtype).element_size() + side_bytes_per_token
        full = max_slots * self.slot_bytes(max_seq_len)
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
        self.memory_bytes = full if memory_bytes is None else memory_bytes
        self._headroom = 0 if self.memory_bytes >= full else int(ADMISSION_HEADROOM * self.memory_bytes)
        self.memory_used = 0
        self.lengths = torch.zeros(max_slots, dtype=torch.int64)        # (S,) CPU
        self._free = set(range(max_slots))
        self._keys: list[torch.Tensor | None] = [None] * max_slots
        self._values: list[torch.Tensor | None] = [None] * max_slots
        self._layers: list[tuple | None] = [None] * max_slots  # (keys, values), each L per-layer views
        self._capacity = [0] * max_slots
        self._heads = torch.arange(config.num_kv_heads, device=device).view(1, -1)
        self.reclaimer: Reclaimer | None = None

    # ------------------------------------------------------------------ memory

    def capacity_for(self, length: int) -> int:
        """Positions a slot holding `length` tokens is given: whole SLOT_BLOCKs, at most
        max_seq_len rounded up to whole KEY_BLOCKs (so every window of whole key blocks fits)."""
        return min(-(-length // SLOT_BLOCK) * SLOT_BLOCK, -(-self.max_seq_len // KEY_BLOCK) * KEY_BLOCK)

    def slot_bytes(self, length: int) -> int:
        """Bytes of a slot's storage when it holds `length` tokens (0 for none)."""
        capacity = self.capacity_for(length)
        return capacity and (capacity + 1) * self.bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.memory_used

    def capacity(self, slot: int) -> int:
        """Positions slot's storage holds now (0: none yet)."""
        return self._capacity[slot]

    def tensors(self, slot: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """slot's k, v storage, (L, Hkv, C + 1, D) each, or None before its first block."""
        return self._keys[slot], self._values[slot]

    @property
    def num_admissible(self) -> int:
        """New requests of one block each that `allocate` would take now (heartbeats' free_slots)."""
        evictable = 0 if self.reclaimer is None else self.reclaimer.evictable_bytes
        room = self.memory_bytes - self.memory_used + evictable - \
            (self._headroom if self.num_free < self.max_slots else 0)
        return max(0, min(self.num_free, room // self.slot_bytes(1)))

    def _grow_bytes(self, slots: list[int], ends: list[int]) -> int:
        """Bytes more that slots need to hold ends[i] tokens each (ends >= 1)."""
        return sum(max(0, self.slot_bytes(end) - self.slot_bytes(self._capacity[s])) for s, end in zip(slots, ends))

    def _grow(self, slot: int, length: int) -> None:
        """Reallocate slot's storage to capacity_for(length) positions; keeps what it holds."""
        capacity = self.capacity_for(length)
        old = self._capacity[slot]
        if capacity <= old:
            return
        L, Hkv, D = self._dims
        keys = torch.zeros(L, Hkv, capacity + 1, D, device=self.device, dtype=self.dtype)
        values = torch.zeros_like(keys)
        if old:
            keys[:, :, :old] = self._keys[slot][:, :, :old]
            values[:, :, :old] = self._values[slot][:, :, :old]
        self._keys[slot], self._values[slot] = keys, values
        self._layers[slot] = (keys.unbind(0), values.unbind(0))
        self.memory_used += self.slot_bytes(capacity) - self.slot_bytes(old)
        self._capacity[slot] = capacity

    def reserve(self, slot: int, length: int) -> None:
        """Grow slot's storage to hold `length` tokens (never shrinks it). CacheCapacityError
        past max_seq_len, CacheMemoryError when the budget cannot hold it; either changes nothing."""
        if not self._is_allocated(slot):
            raise SlotError(f"slot {slot} is not an allocated slot")
        if length > self.max_seq_len:
            raise CacheCapacityError(f"slot {slot}: {length} tokens exceed max_seq_len {self.max_seq_len}")
        self._grow_within_budget([slot], [max(length, 1)], f"slot {slot} needs", f" for {length} tokens")

    def _grow_within_budget(self, slots: list[int], ends: list[int], needs: str, detail: str = "") -> None:
        """Grow slots to hold ends[i] tokens each (ends >= 1), all or none: CacheMemoryError
        ("<needs> N bytes more<detail>"), changing nothing, when the budget cannot hold them."""
        more = self._grow_bytes(slots, ends)
        self._make_room(more)
        if self.memory_used + more > self.memory_bytes:
            raise CacheMemoryError(f"KV cache memory budget {self.memory_bytes} bytes is short: {needs} {more} bytes "
                                   f"more{detail}, {self.memory_bytes - self.memory_used} are free")
        for slot, end in zip(slots, ends):
            self._grow(slot, end)

    # ------------------------------------------------------------------ slots

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, length: int = 0) -> int:
        """Take the lowest free slot, with length 0 and storage for `length` tokens (none for 0:
        then the first `reserve` or forward brings it, as growth).

        Admission: CacheFullError with no free slot; CacheMemoryError when the storage would not
        leave ADMISSION_HEADROOM of the budget for the slots already running (no headroom is
        kept for the first slot, nor when the budget covers every slot at max_seq_len).
        """
        if not self._free:
            raise CacheFullError(f"all {self.max_slots} KV cache slots are in use")
        if length > self.max_seq_len:
            raise CacheCapacityError(f"{length} tokens exceed max_seq_len {self.max_seq_len}")
        need = self.slot_bytes(length)
        headroom = self._headroom if self.num_free < self.max_slots else 0
        if need:
            self._make_room(need + headroom)
        if need and self.memory_used + need + headroom > self.memory_bytes:
            raise CacheMemoryError(
                f"KV cache memory budget {self.memory_bytes} bytes is short: a new request of {length} tokens "
                f"needs {need} bytes plus {headroom} kept for running requests, "
                f"{self.memory_bytes - self.memory_used} are free")
        slot = min(self._free)
        self._free.remove(slot)
        self.lengths[slot] = 0
        if length:
            self._grow(slot, length)
        return slot

    def _is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_slots and slot not in self._free

    def free(self, slot: int) -> None:
        """Return slot and release its storage."""
        if not self._is_allocated(slot):
            raise SlotError(f"slot {slot} is not an allocated slot")
        self._free.add(slot)
        self.lengths[slot] = 0
        self.memory_used -= self.slot_bytes(self._capacity[slot])
        self._keys[slot] = self._values[slot] = self._layers[slot] = None
        self._capacity[slot] = 0

    def detach(self, slot: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Free slot like `free`, but hand its k, v storage (L, Hkv, C + 1, D) to the caller with
        its bytes, which stay charged to the budget until `release_bytes`."""
        keys, values = self.tensors(slot)
        nbytes = self.slot_bytes(self._capacity[slot])
        self.free(slot)
        self.memory_used += nbytes
        return keys, values, nbytes

    def release_bytes(self, nbytes: int) -> None:
        """Storage of `detach` given up: its bytes are free again."""
        self.memory_used -= nbytes

    def _make_room(self, nbytes: int) -> None:
        """Ask the reclaimer for what nbytes more would exceed of the budget."""
        short = self.memory_used + nbytes - self.memory_bytes
        if short > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(short)

    def copy_prefix(self, slot: int, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
        """Positions lengths[slot]..end-1 of keys, values (L, Hkv, >= end, D) into slot's storage,
        which must hold them (`reserve`), and commit them: the slot then holds end tokens."""
        start = int(self.lengths[slot])
        if not start <= end <= self._capacity[slot]:
            raise SlotError(f"copy into slot {slot} of positions {start}..{end - 1}: its storage holds "
                            f"{self._capacity[slot]}")
        self._keys[slot][:, :, start:end] = keys[:, :, start:end]
        self._values[slot][:, :, start:end] = values[:, :, start:end]
        self.lengths[slot] = end

    def truncate(self, slot: int, length: int) -> None:
        """Roll slot back to `length` committed tokens (never grows it)."""
        if not self._is_allocated(slot):
            raise SlotError(f"slot {slot} is not an allocated slot")
        current = int(self.lengths[slot])
        if not 0 <= length <= current:
            raise SlotError(f"truncate slot {slot} to {length}: must be in [0, {current}] "
                            f"(truncate only lowers the committed length)")
        self.lengths[slot] = length

    # ------------------------------------------------------------------ one forward

    def plan(self, slots: torch.Tensor, num_new: torch.Tensor, T: int) -> ForwardPlan:
        """Check a batch, grow its slots' storage, build its index tensors on the cache's device.

        slots: (B,) int64; num_new: (B,) int64 in [0, T]. Raises SlotError,
        CacheCapacityError or CacheMemoryError before anything is written (a slot without
        storage gets a block even with num_new 0: its padding writes need a scratch column).
        Built from Python lists with one tensor creation and one host-to-device copy: at batch 1
        the per-call cost of many small tensor ops would rival the forward of a small draft
        model. The plan carries its slots' storage, which `update` and `window` read.
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
        self._grow_within_budget(slot_list, [max(end, 1) for end in ends], f"slots {slot_list} need")
        last = self.max_seq_len - 1
        write_pos = [[start + t if t < n else self._capacity[s] for t in range(T)]
                     for s, start, n in zip(slot_list, starts, new_list)]
        rope_pos = [[min(start + t, last) for t in range(T)] for start in starts]
        index = torch.tensor([write_pos, rope_pos]).to(self.device)  # (2, B, T)
        # Index rows and window views made once here, not in each layer's update and window.
        keys, values = [self._layers[s][0] for s in slot_list], [self._layers[s][1] for s in slot_list]
        return ForwardPlan(write_pos=index[0], rope_pos=index[1], keys=keys, values=values,
                           write_columns=list(index[0].unbind(0)),
                           groups=window_groups(self, slot_list, ends, keys, values))

    def update(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (B, T, Hkv, D) of `layer` into the plan's slots at its write_pos (B, T).
        All on the cache's device; a slot's last column is its scratch column for padding."""
        assert len(plan.keys) == k.shape[0] == plan.write_pos.shape[0], (len(plan.keys), k.shape)
        kernel = fixed_kernel(k)
        for keys, values, columns, k_row, v_row in zip(plan.keys, plan.values, plan.write_columns,
                                                       k.unbind(0), v.unbind(0)):
            if kernel is not None:  # one call a row instead of two index_put_ (each op costs microseconds)
                kernel.kv_write(keys[layer], values[layer], k_row, v_row, columns)
            else:
                keys[layer].index_put_((self._heads, columns.view(-1, 1)), k_row)
                values[layer].index_put_((self._heads, columns.view(-1, 1)), v_row)

    def window(self, layer: int, group: WindowGroup):
        """Keys and values at positions 0..W-1 of a window group's slots: two (Bg, Hkv, W, D)
        tensors. Views of the slot's storage for a group of one row; gathered copies for
        several, zeros past a slot's storage (a shorter slot in the group: masked keys).
        """
        if group.views is not None:
            return group.views[layer]
        W = group.window
        if all(t[layer].shape[1] >= W for t in group.keys):
            return (torch.stack([t[layer][:, :W] for t in group.keys]),
                    torch.stack([t[layer][:, :W] for t in group.values]))
        L, Hkv, D = self._dims
        out_k = torch.zeros(len(group.keys), Hkv, W, D, device=self.device, dtype=self.dtype)
        out_v = torch.zeros_like(out_k)
        for b, (keys, values) in enumerate(zip(group.keys, group.values)):
            n = min(W, keys[layer].shape[1])
            out_k[b, :, :n] = keys[layer][:, :n]
            out_v[b, :, :n] = values[layer][:, :n]
        return out_k, out_v

    def commit(self, slots: torch.Tensor, num_new: torch.Tensor) -> None:
        """Advance lengths[slots] (B,) by num_new (B,) after a forward has written them."""
        self.lengths.index_add_(0, slots.cpu(), num_new.cpu())


def window_groups(cache: KVCache, slot_list: list[int], ends: list[int], keys: list,
                  values: list) -> list[WindowGroup]:
    """A forward's rows by window (`KVCache.plan`; keys, values: ForwardPlan's). Row b needs
    ceil(ends[b] / KEY_BLOCK) key blocks; rows whose needs share a power-of-two bound (1, 2,
    3-4, 5-8, ...) form a group whose window is its largest need, so a row reads at most twice
    the keys it needs, in at most log2(max_seq_len / KEY_BLOCK) + 1 groups (an attention call
    each per layer). Whole key blocks: the storage of a group's slot that reaches furthest
    holds them (capacity_for)."""
    blocks = [-(-max(end, 1) // KEY_BLOCK) for end in ends]
    buckets: dict[int, list[int]] = {}
    for b, nb in enumerate(blocks):
        buckets.setdefault((nb - 1).bit_length(), []).append(b)
    groups = []
    for _, rows in sorted(buckets.items()):
        window = max(blocks[b] for b in rows) * KEY_BLOCK
        views = None
        if len(rows) == 1:  # the window is a view of the slot's storage, (1, Hkv, W, D) per layer
            views = list(zip(*(t[:, :, :window].unsqueeze(1).unbind(0) for t in cache.tensors(slot_list[rows[0]]))))
        groups.append(WindowGroup(rows=None if len(rows) == len(ends) else torch.tensor(rows, device=cache.device),
                                  window=window, keys=[keys[b] for b in rows], values=[values[b] for b in rows],
                                  views=views))
    return groups
