"""Continuous batching: which sequences run in the next step with how many tokens, and which adapters must be
copied into device slots first. Pure bookkeeping over requests, slots and KV blocks (no model, no tensors), so every
rank of a TP group, given the same calls, makes the same plans.

Each step (schedule()):
1. Every running decoding sequence gets one token (max_tokens_per_step >= max_batch_size, so they always fit), then
   sequences still in their prompt get chunks of what is left of the budget, oldest first (chunked prefill).
2. Waiting requests are admitted first come, first served while the batch, the free KV blocks and the budget last;
   an admitted request takes the blocks of its prompt (and first new token), and a running sequence takes one
   more block whenever its next token crosses into one. When none is free, the newest running sequence is preempted:
   its blocks and slot are freed and it goes back to the head of the queue, to recompute its prompt and the tokens
   it generated when readmitted (the same tokens, greedy or seeded: they are kept, not sampled again).
   A request needs its adapter in a slot: if resident it joins that slot; otherwise a slot no running sequence uses is
   reassigned (SlotState.victim: empty first, then one whose adapter none of the next waiting requests wants, then
   one outside the most recently used half, the adapter admitted least often lately among those) and
   returned in the plan's `loads`, which the engine copies in before the plan's step runs: the admitted request
   prefills in that same step (a separate prefill step would be one more eagerly run step per load). The engine
   names the adapters it can copy in at once (`loadable`: read into host memory); a request whose adapter is still
   being read waits like one without a free slot, so a read never stalls the batch.
   A budget too short for every waiting prefill: cached prefixes first (tp_lora.engine.cached_first; bounded).
   With admit_batch = k > 1, while sequences are decoding, admission waits until min(k, waiting) requests fit
   (blocks and batch room) and have their adapters resident or loadable: each admission turns a decode-only step
   into a costlier mixed step (its prefill chunk), so under a full batch admissions are grouped instead of trickling
   in one per step.
3. No free slot (or its adapter not loadable yet) for a request R: later requests whose adapter is resident (or
   loadable) may pass it (they batch with sequences already running: adapter-aware grouping), and each admission
   that passes R charges R once. Once R has been charged max_overtakes times nothing behind it is admitted until it
   is. The scan stops after LOOKAHEAD blocked requests, so a step costs O(LOOKAHEAD x slots) however long the queue.

No starvation: a charged-out request R stops admission behind it, so only requests ahead of R (finitely many, none
added) can still enter. Every running sequence finishes in a bounded number of steps (decodes always get their token;
the oldest prefill always gets >= 1 budget token, since at most max_batch_size - 1 others decode). So the slots'
users drain, a slot frees, and it goes to the first blocked request in queue order; by induction R is admitted after
at most max_overtakes passes plus the drain time of what runs ahead of it. admit_batch only waits for sequences to
finish, which they do in bounded time, and a request waiting for its adapter's read waits for a read that ends (read
or failed) in bounded time, the engine reading it itself once nothing else can run; so the bound stays finite.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from tp_lora.engine.cached_first import CachedFirst
from tp_lora.engine.kv_pool import BlockPool
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.slot_state import SlotState

LOOKAHEAD = 64  # waiting requests whose adapters a victim choice tries not to evict


@dataclass(eq=False)  # identity: the scheduler's list lookups must not compare token lists
class Sequence:
    request: Request
    blocks: list[int]  # KV-cache blocks holding positions 0, 1, ... (its block table)
    slot: int  # adapter slot, -1 for none
    tokens: list[int]
    prompt_len: int
    computed: int = 0  # tokens already in the KV cache
    result: Optional[Result] = None
    stopped: bool = False  # left the running set for good (finished, cancelled, dropped): a launched step drops its
    # row (a preempted sequence is in no step launched since)
    root: int = 0  # its adapter's identity in the prefix cache (BlockPool)
    hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of its first full blocks

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        """More than one token to compute (a prompt, or the recompute of a preempted sequence)."""
        return self.computed < len(self.tokens) - 1


@dataclass
class StepPlan:
    work: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, its new tokens this step)
    loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter) the engine must copy in
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class Scheduler:
    """identity(adapter name or None) -> the adapter's prefix-cache identity (BlockPool's root)."""

    def __init__(self, slots: SlotState, blocks: BlockPool, max_batch_size: int, max_tokens_per_step: int,
                 max_overtakes: int = 16, lookahead: int = LOOKAHEAD, admit_batch: int = 1,
                 identity: Callable[[Optional[str]], int] = lambda name: 0, max_prefix_overtakes: int = 0):
        if max_tokens_per_step < max_batch_size:
            raise ValueError(f"max_tokens_per_step={max_tokens_per_step} < max_batch_size={max_batch_size}: every "
                             f"running sequence decodes one token per step")
        self.slots, self.blocks = slots, blocks
        self.max_batch_size, self.max_tokens_per_step = max_batch_size, max_tokens_per_step
        self.max_overtakes, self.lookahead = max_overtakes, lookahead
        self.cached_first = CachedFirst(max_prefix_overtakes)
        if admit_batch < 1:
            raise ValueError(f"admit_batch={admit_batch}: expected >= 1")
        self.admit_batch = min(admit_batch, max_batch_size)
        self.waiting: list[Request] = []
        self.running: list[Sequence] = []
        self.passed: dict[int, int] = {}  # request index -> times a later request was admitted before it
        self.preempted: dict[int, Sequence] = {}  # request index -> its sequence, waiting to be readmitted
        self.preemptions = 0
        self.admitting = True
        self.slot_hits = 0  # admissions whose adapter was resident
        self.slot_misses = 0  # admissions that needed a copy into a slot
        self.prefix_hits = 0  # prompt tokens new admissions found in the prefix cache
        self.identity = identity
        self._chains: dict[int, list[int]] = {}  # waiting request index -> its prompt's block hashes so far

    # ---- queue ----------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or (self.admitting and bool(self.waiting))

    # ---- planning -------------------------------------------------------------------------------------------
    def may_admit(self) -> bool:
        """Whether the next schedule() may admit anything (room in the batch, in the KV blocks, for a group)."""
        decoding = any(self._ready(s) and not s.prefilling for s in self.running)
        return (self.admitting and bool(self.waiting) and len(self.running) < self.max_batch_size
                and self._fitting(1) == 1 and self._room_for_a_group(decoding))

    def schedule(self, loadable: Optional[set[str]] = None, admit: bool = True, ending=()) -> StepPlan:
        """loadable: the adapters not in a slot that may be copied into one for this step (None: any). admit: whether
        waiting requests may enter. ending: running sequences that get no token (they end with what they have)."""
        plan = StepPlan()
        budget = self.max_tokens_per_step
        decoding = [s for s in self.running if self._ready(s) and not s.prefilling and s not in ending]
        preemptions = self.preemptions
        for seq in decoding:
            if self.preemptions == preemptions or seq in self.running:  # not preempted for an older one's room
                self._make_room(seq)
        if self.preemptions != preemptions:
            decoding = [s for s in decoding if s in self.running]
        for seq in decoding:
            plan.work.append((seq, 1))
        budget -= len(decoding)
        for seq in self.running:
            if budget > 0 and self._ready(seq) and seq.prefilling:
                n = min(len(seq.tokens) - seq.computed, budget)
                plan.work.append((seq, n))
                budget -= n
        if admit and self.admitting and self._room_for_a_group(bool(decoding), loadable):
            arrival = {id(r): k for k, r in enumerate(self.waiting)}
            order = self._cached_first_order(budget) if self.cached_first.max_passes else None
            if order is not None:
                self.waiting[:len(order)] = order
            self._admit(plan, budget, loadable)
            if order is not None:
                self.waiting.sort(key=lambda r: arrival[id(r)])
                self.cached_first.charge(self.waiting, arrival, [seq.request for seq in plan.admitted])
        return plan

    def _cached_first_order(self, budget: int) -> Optional[list[Request]]:
        """The first `lookahead` waiting requests in cached-first order (CachedFirst.order), or None."""
        window = self.waiting[:self.lookahead]
        tokens = [self._tokens(r) for r in window]
        cached = [len(self.blocks.match(t, self.identity(r.adapter), self._chain(r))[0]) * self.blocks.block_size
                  for r, t in zip(window, tokens)]
        return self.cached_first.order(window, cached, sum(map(len, tokens)) - sum(cached), budget, set(self.preempted))

    def _room_for_a_group(self, decoding: bool, loadable: Optional[set[str]] = None) -> bool:
        """Whether to admit now: always when nothing decodes, else once a group fits and (when `loadable` is
        given) that many waiting requests have their adapter in a slot or loadable."""
        if self.admit_batch == 1 or not decoding:
            return True
        group = self.group_size
        if min(self.max_batch_size - len(self.running), self._fitting(group)) < group:
            return False
        if loadable is None:
            return True
        n = 0
        for req in self.waiting[:self.lookahead]:
            n += req.adapter is None or req.adapter in loadable or self.slots.slot_of(req.adapter) is not None
            if n >= group:
                return True
        return False

    @property
    def group_size(self) -> int:
        """How many waiting requests an admission waits for while sequences decode."""
        return min(self.admit_batch, len(self.waiting))

    def _chain(self, req: Request) -> list[int]:
        """The prefix-cache hashes of a waiting request's first blocks known so far (a preempted sequence's are its
        own: its blocks were cached as it left)."""
        seq = self.preempted.get(req.index)
        return seq.hashes if seq is not None else self._chains.setdefault(req.index, [])

    def _tokens(self, req: Request) -> list[int]:
        """What a waiting request computes when admitted: its prompt, or a preempted sequence's tokens so far."""
        seq = self.preempted.get(req.index)
        return seq.tokens if seq is not None else req.prompt_token_ids

    def _fitting(self, n: int) -> int:
        """How many of the first n waiting requests the free KV blocks hold together (with their first new token)."""
        free, k = self.blocks.available, 0
        for req in self.waiting[:n]:
            free -= self._blocks_to_admit(req)
            if free < 0:
                break
            k += 1
        return k

    def _blocks_to_admit(self, req: Request) -> int:
        """Available blocks admitting `req` uses up: its new blocks, and the cached ones it takes from eviction."""
        tokens = self._tokens(req)
        cached, _ = self.blocks.match(tokens, self.identity(req.adapter), self._chain(req))
        return self.blocks.needed(cached, len(tokens) + 1) + self.blocks.evictable_in(cached)

    def _make_room(self, seq: Sequence) -> None:
        """Blocks for the decoding sequence's next token, preempting the newest running sequences (possibly seq
        itself) while none is free."""
        if seq.computed < len(seq.blocks) * self.blocks.block_size:  # its blocks hold the next position already
            return
        while self.blocks.needed(seq.blocks, seq.computed + 1) > self.blocks.available:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return
        self.blocks.grow(seq.blocks, seq.computed + 1)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and slot and queue it first, to be recomputed when readmitted."""
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.preempted[seq.request.index] = seq
        self.waiting.insert(0, seq.request)
        self.preemptions += 1

    def _ready(self, seq: Sequence) -> bool:
        return seq.slot < 0 or self.slots.ready[seq.slot]

    def _admit(self, plan: StepPlan, budget: int, loadable: Optional[set[str]]) -> None:
        blocked = 0  # requests skipped in this scan for want of a slot (or of their adapter's read)
        worst = 0  # the most any of them has been passed
        i = 0
        prefilling = self._prefilling_leaders()
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.max_batch_size
               and self._blocks_to_admit(self.waiting[i]) <= self.blocks.available):
            if blocked and (worst >= self.max_overtakes or blocked > self.lookahead):
                break  # a request passed max_overtakes times is a barrier; and the scan stays short
            req = self.waiting[i]
            if req.sibling_of in prefilling:  # waits for its first sibling's prompt blocks (not an overtake)
                i += 1
                continue
            prefilling.add(req.index)
            slot = self._slot_for(req, i, plan, loadable)
            if slot is None:
                blocked += 1
                worst = max(worst, self.passed.get(req.index, 0))
                i += 1
                continue
            del self.waiting[i]
            self.passed.pop(req.index, None)
            self.cached_first.forget(req.index)
            if blocked:
                for b in self.waiting[:i]:  # exactly the blocked ones: everything else ahead was admitted
                    self.passed[b.index] = self.passed.get(b.index, 0) + 1
                worst += 1
            if slot >= 0:
                self.slots.acquire(slot)
            seq = self.preempted.pop(req.index, None)
            if seq is None:
                seq = Sequence(req, [], slot, list(req.prompt_token_ids), len(req.prompt_token_ids),
                               result=Result(req))
                plan.admitted.append(seq)
                fresh = True
            else:
                fresh = False
            seq.slot, seq.root = slot, self.identity(req.adapter)
            seq.blocks, seq.hashes = self.blocks.match(seq.tokens, seq.root, self._chain(req))
            self._chains.pop(req.index, None)
            self.blocks.take(seq.blocks)
            seq.computed = len(seq.blocks) * self.blocks.block_size
            if fresh:
                self.prefix_hits += seq.computed
            self.blocks.grow(seq.blocks, len(seq.tokens) + 1)
            self.running.append(seq)
            if self._ready(seq) or any(slot == s for s, _ in plan.loads):
                n = min(len(seq.tokens) - seq.computed, budget)
                plan.work.append((seq, n))
                budget -= n

    def _prefilling_leaders(self) -> set[int]:
        """The requests whose prompt is not computed yet (running or waiting), when a waiting request is a later
        sibling (n / best_of) of one of them: its siblings wait for its prompt's blocks."""
        if not any(r.sibling_of is not None for r in self.waiting):
            return set()
        return ({s.request.index for s in self.running if s.computed < s.prompt_len}
                | {r.index for r in self.waiting})

    def _slot_for(self, req: Request, pos: int, plan: StepPlan, loadable: Optional[set[str]]) -> Optional[int]:
        """-1 for no adapter, the slot holding req.adapter (reassigning a free one), or None: no slot free, or the
        adapter not loadable yet."""
        name = req.adapter
        if name is None:
            return -1
        slot = self.slots.slot_of(name)
        if slot is not None:
            self.slot_hits += 1
            return slot
        if loadable is not None and name not in loadable or not self.slots.any_free():
            return None
        soon = {w.adapter for w in self.waiting[pos + 1:pos + 1 + self.lookahead]}
        slot = self.slots.victim(soon)
        self.slots.assign(slot, name)
        plan.loads.append((slot, name))
        self.slot_misses += 1
        return slot

    # ---- outcomes -------------------------------------------------------------------------------------------
    def loaded(self, slot: int) -> None:
        self.slots.loaded(slot)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.stopped = True

    def cache_blocks(self, seq: Sequence) -> None:
        """seq's KV now holds its first seq.computed positions: its full blocks of known tokens enter the cache."""
        self.blocks.commit(seq.blocks, seq.tokens, seq.computed, seq.hashes, seq.root)

    def _free(self, seq: Sequence) -> None:
        self.cache_blocks(seq)
        self.blocks.release(seq.blocks)
        if seq.slot >= 0:
            self.slots.release(seq.slot)

    def fail_adapter(self, name: str) -> list[Request]:
        """The adapter cannot be loaded: drop its running sequences and waiting requests (returned, running first)
        and free its slot."""
        out = []
        for seq in [s for s in self.running if s.request.adapter == name]:
            self.finish(seq)
            out.append(seq.request)
        slot = self.slots.slot_of(name)
        if slot is not None and not self.slots.pinned:
            self.slots.clear(slot)
        out += [r for r in self.waiting if r.adapter == name]
        self.waiting = [r for r in self.waiting if r.adapter != name]
        for r in out:
            self.passed.pop(r.index, None)
            self.cached_first.forget(r.index)
            self._chains.pop(r.index, None)
            self.preempted.pop(r.index, None)
        return out

    def remove(self, index: int):
        """Drop request `index` (its client went away): its running Sequence (blocks and slot freed), or its waiting
        Request (a preempted one's Sequence), or None when neither holds it."""
        for seq in self.running:
            if seq.request.index == index:
                self.finish(seq)
                return seq
        for i, req in enumerate(self.waiting):
            if req.index == index:
                del self.waiting[i]
                self.passed.pop(index, None)
                self.cached_first.forget(index)
                self._chains.pop(index, None)
                return self.preempted.pop(index, req)
        return None

    def stop_admitting(self) -> list[Request]:
        """Admit nothing more; returns the requests that were still waiting (they will not run)."""
        self.admitting = False
        out, self.waiting = self.waiting, []
        self.passed.clear()
        self.cached_first.clear()
        self._chains.clear()
        self.preempted.clear()
        return out

    def abort(self) -> list[Sequence]:
        """Drop every running sequence (returned) and free its blocks and slot."""
        out, self.running = self.running, []
        for seq in out:
            self._free(seq)
            seq.stopped = True
        return out
