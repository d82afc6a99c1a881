"""PrefixCache: later requests reuse a prompt already computed (multi-turn chat, a shared system prompt).

Kimi-Linear's KDA layers carry a recurrent state that cannot be rewound, so a prefix can only be reused where a
snapshot of that state was taken. The scheduler takes one at the end of each prompt of at least `min_tokens`
tokens (the step whose chunk completes the prompt, after its forward): the KDA state slot is copied into a slot of
the cache, the prompt's full MLA pages are shared (reference counted; nobody writes into them again, since a
request only writes past its cached prefix), and its last, partial page is copied into a page of the cache. A
request whose tokens begin with a cached prompt and go on past it starts there: its slot gets a copy of the
snapshot, its block table the shared pages plus a fresh copy of the partial page.

Entries live in a fixed number of extra state slots (`max_entries`); the least recently used one is evicted when
slots or pages run short, before any request is preempted. Pure Python bookkeeping: the copies are listed in the
SchedulerOutput and done by the runner.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from backend.engine.memory import BlockPool, StatePool


@dataclass(slots=True)
class Entry:
    tokens: list  # the prompt this snapshot ends
    slot: int  # KDA state after the last token (owned)
    full_pages: list  # its first len(tokens) // block_size MLA pages (shared, one reference held here)
    partial_page: int  # a copy of the page holding the last len(tokens) % block_size tokens (owned), 0 = none

    @property
    def pages(self) -> list:
        """Every page this entry holds a reference on."""
        return self.full_pages + ([self.partial_page] if self.partial_page else [])


class PrefixCache:
    def __init__(self, blocks: BlockPool, states: StatePool, max_entries: int, min_tokens: int):
        assert max_entries >= 1 and min_tokens >= 1
        self.blocks = blocks
        self.states = states
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        self._entries: OrderedDict = OrderedDict()  # id -> Entry, least recently used first
        self._by_last: dict = {}  # (length, last token) -> ids of the entries (a quick first filter)
        self._next_id = 0
        self._reserved = 0  # snapshots reserved and not yet inserted or given back (they count against max_entries)
        self.hits = 0
        self.hit_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: list, limit: int) -> Optional[Entry]:
        """The longest entry whose prompt is a prefix of `tokens` and no longer than `limit` (marked recently used)."""
        best_id, best = None, None
        for eid, e in self._entries.items():
            n = len(e.tokens)
            if n <= limit and (best is None or n > len(best.tokens)) and tokens[n - 1] == e.tokens[-1] \
                    and tokens[:n] == e.tokens:
                best_id, best = eid, e
        if best is not None:
            self._entries.move_to_end(best_id)
        return best

    def has(self, tokens: list) -> bool:
        """An entry ends exactly these tokens (marked recently used)."""
        for eid in self._by_last.get((len(tokens), tokens[-1]), ()):
            if self._entries[eid].tokens == tokens:
                self._entries.move_to_end(eid)
                return True
        return False

    def wants(self, tokens: list) -> bool:
        return len(tokens) >= self.min_tokens and not self.has(tokens)

    def reserve(self, partial: bool) -> Optional[tuple]:
        """A slot (and a page if `partial`) for a new snapshot, evicting old entries if needed -> (slot, page), or
        None when they cannot be had. Reservations not yet inserted count against max_entries (several prompts
        ending in one step would otherwise each take a slot beyond it)."""
        while len(self._entries) + self._reserved >= self.max_entries or not self.states.can_allocate() \
                or (partial and not self.blocks.can_allocate(1)):
            if not self.evict():
                return None
        self._reserved += 1
        return self.states.allocate(), (self.blocks.allocate(1)[0] if partial else 0)

    def unreserve(self, slot: int, page: int) -> None:
        assert self._reserved > 0
        self._reserved -= 1
        self.states.free(slot)
        if page:
            self.blocks.free([page])

    def insert(self, tokens: list, slot: int, page: int, pages: list) -> None:
        """Registers a snapshot (reserve()'s slot and page, filled by the runner) of `tokens`, whose full pages are
        pages[:len(tokens) // block_size] (one more reference taken on them)."""
        assert self._reserved > 0
        self._reserved -= 1
        full = list(pages[:len(tokens) // self.blocks.block_size])
        self.blocks.share(full)
        eid, self._next_id = self._next_id, self._next_id + 1
        self._entries[eid] = Entry(list(tokens), slot, full, page)
        self._by_last.setdefault((len(tokens), tokens[-1]), []).append(eid)

    def take(self, hit: Entry) -> list:
        """A request starts after `hit` (a lookup() result) -> its block table so far: hit's full pages, one more
        reference taken on each (the partial page the caller copies into a page of the request's own)."""
        self.blocks.share(hit.full_pages)
        self.hits += 1
        self.hit_tokens += len(hit.tokens)
        return list(hit.full_pages)

    def reclaimable(self, keep: Optional[Entry] = None) -> int:
        """Pages that evicting every entry but `keep` would free (those no request holds)."""
        held = {}
        for e in self._entries.values():
            if e is not keep:
                for p in e.pages:
                    held[p] = held.get(p, 0) + 1
        return sum(self.blocks.ref_count[p] == n for p, n in held.items())

    def evict(self, keep: Optional[Entry] = None) -> bool:
        """Drops the least recently used entry other than `keep` -> whether one was dropped."""
        for eid, e in self._entries.items():
            if e is not keep:
                break
        else:
            return False
        del self._entries[eid]
        ids = self._by_last[(len(e.tokens), e.tokens[-1])]
        ids.remove(eid)
        if not ids:
            del self._by_last[(len(e.tokens), e.tokens[-1])]
        self.blocks.free(e.pages)
        self.states.free(e.slot)
        self.evictions += 1
        return True

    def clear(self) -> None:
        while self.evict():
            pass
