"""BlockPool (MLA latent pages) and StatePool (KDA state slots): bookkeeping only, no tensors.

Page 0 and slot 0 are null sinks: padded lanes point at them, so they are never handed out.
"""

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2, f"need at least 2 pages (page 0 is the null page), got {num_blocks}"
        assert block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.free_ids = deque(range(1, num_blocks))

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int) -> list:
        assert self.can_allocate(n), f"{n} pages asked, {len(self.free_ids)} free"
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            assert self.ref_count[i] == 0
            self.ref_count[i] = 1
        return ids

    def share(self, ids) -> None:
        """One more holder of these allocated pages (a prefix cache entry, a request reusing it)."""
        for i in ids:
            assert i != 0 and self.ref_count[i] > 0, f"page {i} shared but not allocated"
            self.ref_count[i] += 1

    def free(self, ids) -> None:
        # reverse order: a request's tail pages go back first
        for i in reversed(ids):
            assert i != 0 and self.ref_count[i] > 0, f"page {i} freed twice or never allocated"
            self.ref_count[i] -= 1
            if self.ref_count[i] == 0:
                self.free_ids.append(i)


class StatePool:
    def __init__(self, num_slots: int):
        assert num_slots >= 2, f"need at least 2 state slots (slot 0 is the null slot), got {num_slots}"
        self.num_slots = num_slots
        self.used = [False] * num_slots
        self.free_ids = deque(range(1, num_slots))

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def can_allocate(self) -> bool:
        return bool(self.free_ids)

    def allocate(self) -> int:
        assert self.free_ids, "no free state slot"
        slot = self.free_ids.popleft()
        self.used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        assert slot != 0 and self.used[slot], f"slot {slot} freed twice or never allocated"
        self.used[slot] = False
        self.free_ids.append(slot)
