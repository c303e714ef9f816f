"""Calibrated continuous-batching model of ONE vLLM instance: the ``sim`` engine core.

One cost model in one place, used by the live ``sim`` worker (an async wrapper that calls
:meth:`SimEngineCore.step` and sleeps for its duration) and by the discrete-event
simulator (which calls :meth:`SimEngineCore.advance`). Pure code: no I/O, no clock of its
own, no randomness; ``now`` is passed in.

Cost model (BLIS "blackbox" fit, inference-sim/inference-sim ``coefficients.yaml``)::

    step time = β0 + β1 · (prefill tokens in the step) + β2 · (decode tokens in the step)

Scheduler (vLLM v1, recompute preemption, no prefix caching), once per step. Waiting
sequences are kept in (priority, arrival) order, as vLLM's ``--scheduling-policy
priority`` keeps them (lower value first); with every priority equal — the default 0 —
that is vLLM's FCFS policy exactly:

1. Running sequences in admission order each need their next tokens: 1 for a decoding
   sequence, ``min(remaining prefill, budget)`` for the partially prefilled one. Budget =
   ``max_num_batched_tokens``. The partially prefilled sequence is always the newest
   running one (a partial chunk exhausts the budget, so nothing is admitted after it), so
   this order is "decodes first, then prefill chunks".
2. KV: a sequence that has computed ``c`` tokens holds ``ceil(c / block_size)`` blocks; a
   step that computes ``n`` more allocates up to ``ceil((c + n) / block_size)``. For a
   decoding sequence with P prompt and g generated tokens the step computes token P + g
   (the last sampled one), so it holds ``ceil((P + g) / block_size)`` blocks. When the
   pool is short, the running sequence with the largest (priority, arrival) — the lowest
   class, and the newest within it — is preempted (blocks freed, a block it was given in
   this step handed back, put back in waiting at its (priority, arrival) place, its P + g
   tokens recomputed by a later prefill, ``preemptions`` counted), repeatedly, until the
   allocation fits or the needy sequence was itself the victim. That is vLLM's priority
   policy (``max(running, key=(priority, arrival_time))``); with every priority equal the
   victim is the newest running sequence and it goes back to the FRONT of waiting,
   exactly vLLM's FCFS (``running.pop()``, ``prepend_request``).
3. If nothing was preempted, waiting sequences are admitted in that order while
   ``len(running) < max_num_seqs``, budget remains, and the blocks for their first chunk
   are free (no watermark). The head blocks the queue: no skipping. A sequence admitted
   with ``cached_tokens`` (KV computed elsewhere) holds their blocks from admission on and
   computes only the rest of its prompt; the cached tokens use no budget.
4. At the end of the step every sequence whose prefill is complete samples one token; the
   first one sets ``first_token``; reaching ``max_output_tokens`` finishes the sequence
   and frees its blocks.

Fast-forward. Most steps are "quiet": pure decode, no admission possible, no allocation
failure, nobody finishing. Their number is computed in closed form and they are skipped
at once. The state that makes this O(1) instead of O(k · batch):

- ``G``, a global step counter. A decoding sequence stores ``(g_base, G_base)`` and has
  generated ``g_base + (G - G_base)`` tokens; its finishing step ``G_base + target -
  g_base`` sits in a heap.
- Block boundaries: a decoding sequence needs a new block in the step starting at ``G``
  iff ``G ≡ G_base - c_base (mod block_size)``; ``counts[r]`` holds how many decoding
  sequences have phase ``r``, so the blocks a run of k steps needs is
  ``(k // B) · n + Σ counts`` over the ``k % B`` leading phases.

Time is kept in integer nanoseconds (β rounded to 1 ns), so a jump of k steps lands on
exactly the instant k single steps would reach; tests check equality with ``==``.
Floats in the API are seconds; they round-trip exactly for times below ~10^6 s.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Final, Literal

NS_PER_S: Final = 1_000_000_000
#: Largest KV block a profile may have, in tokens. vLLM's are 1 to 256 (16 by default);
#: the bound leaves room above that while keeping the per-step block arithmetic cheap.
MAX_BLOCK_SIZE: Final = 1024


def to_ns(t_s: float) -> int:
    """Seconds → integer nanoseconds (the core's clock)."""
    return round(t_s * NS_PER_S)


def to_s(t_ns: int) -> float:
    """Integer nanoseconds → seconds."""
    return t_ns / NS_PER_S


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rank(s: _Seq) -> tuple[int, int]:
    """Preemption order: the running sequence with the largest rank goes first."""
    return s.priority, s.order


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Calibration of one model on one GPU (times in seconds, sizes in tokens/blocks/bytes)."""

    name: str
    beta0_s: float
    beta1_s_per_prefill_tok: float
    beta2_s_per_decode_tok: float
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_bytes_per_token: int = 131_072
    model: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"EngineProfile.{f.name} must be finite, got {value!r}")
            if isinstance(value, int | float) and not value > 0:
                raise ValueError(f"EngineProfile.{f.name} must be > 0, got {value!r}")
        if self.block_size > MAX_BLOCK_SIZE:
            # The quiet-step arithmetic walks one slot per block position: a huge block
            # makes every step O(block_size), and no vLLM runs such blocks.
            raise ValueError(
                f"EngineProfile.block_size must be <= {MAX_BLOCK_SIZE}, got {self.block_size}"
            )
        if round(self.beta0_s * NS_PER_S) < 1:
            # A zero-length step would let the clock stand still while tokens flow.
            raise ValueError("EngineProfile.beta0_s must be at least 1 ns")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM requires this too: every running sequence must fit one decode token.
            raise ValueError(
                "EngineProfile.max_num_batched_tokens must be >= max_num_seqs "
                f"({self.max_num_batched_tokens} < {self.max_num_seqs})"
            )

    @property
    def kv_total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def step_ns(self) -> tuple[int, int, int]:
        """(β0, β1, β2) in integer nanoseconds, the units the core computes in."""
        return (
            round(self.beta0_s * NS_PER_S),
            round(self.beta1_s_per_prefill_tok * NS_PER_S),
            round(self.beta2_s_per_decode_tok * NS_PER_S),
        )

    def max_seq_tokens(self) -> int:
        """Largest prompt + output a sequence may have: its last token is never computed."""
        return self.kv_total_tokens + 1


@dataclass(frozen=True, slots=True)
class SimRequest:
    """What the engine is asked to run. ``max_output_tokens`` is the exact output length."""

    seq_id: int
    prompt_tokens: int
    max_output_tokens: int
    arrival_s: float = 0.0
    #: vLLM's request priority under ``--scheduling-policy priority``: lower runs first.
    #: All equal (the default 0) is exactly FCFS.
    priority: int = 0
    #: Prompt tokens whose KV is already there when the sequence is admitted (a prefill
    #: computed by another engine and shipped over, as vLLM's KV connectors do, or a
    #: prefix-cache hit): they take blocks from the pool but no compute and no step
    #: budget. At most ``prompt_tokens - 1``: the last prompt token is always computed,
    #: its logits give the first output token. A preempted sequence loses them and
    #: recomputes its whole prompt, as vLLM does.
    cached_tokens: int = 0


EventKind = Literal["first_token", "finished", "preempted"]


@dataclass(frozen=True, slots=True)
class SeqEvent:
    """Something that happened to one sequence. ``time_s``: end of the step that produced
    a token; for ``preempted``, the start of the step that evicted it."""

    kind: EventKind
    seq_id: int
    time_s: float
    generated: int
    preemptions: int


@dataclass(frozen=True, slots=True)
class StepResult:
    """One engine step. ``emitted``: sequences that sampled exactly one token in it."""

    start_s: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    first_tokens: tuple[int, ...]
    finished: tuple[int, ...]
    preempted: tuple[int, ...]
    emitted: tuple[int, ...]
    events: tuple[SeqEvent, ...]


class _Seq:
    """Mutable per-sequence state. While decoding, ``generated``/``computed`` are stale and
    derived from the global step counter instead (see the module docstring)."""

    __slots__ = (
        "G_base",
        "cached",
        "computed",
        "decoding",
        "epoch",
        "g_base",
        "generated",
        "order",
        "phase",
        "preemptions",
        "priority",
        "prompt",
        "seq_id",
        "target",
    )

    def __init__(self, req: SimRequest, order: int) -> None:
        self.seq_id = req.seq_id
        self.priority = req.priority
        self.order = order  # add order: FCFS within a priority
        self.prompt = req.prompt_tokens
        self.cached = req.cached_tokens  # KV present at admission; 0 after a preemption
        self.target = req.max_output_tokens
        self.generated = 0
        self.computed = 0
        self.decoding = False
        self.g_base = 0
        self.G_base = 0
        self.phase = 0
        self.epoch = 0  # bumped whenever a heap entry for this sequence becomes stale
        self.preemptions = 0


class SimEngineCore:
    """The state of one simulated vLLM instance. Not thread-safe; one owner drives it."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self._b0, self._b1, self._b2 = profile.step_ns()
        self._bs = profile.block_size
        self._max_seqs = profile.max_num_seqs
        self._max_tokens = profile.max_num_batched_tokens
        self._free = profile.num_blocks
        self._seqs: dict[int, _Seq] = {}
        self._running: dict[int, _Seq] = {}  # insertion order = admission order
        self._waiting: deque[_Seq] = deque()  # sorted by (priority, order)
        self._adds = 0
        self._tail: _Seq | None = None  # the running sequence still in prefill, if any
        self._n_dec = 0
        self._counts = [0] * self._bs
        self._heap: list[tuple[int, int, int, _Seq]] = []  # (finish G, push no, epoch, seq)
        self._pushes = 0
        self._G = 0
        self._ready = 0  # ns: end of the last step; the next step starts no earlier
        self.steps = 0
        self.preemptions = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.busy_ns = 0

    # ---- capacity views -------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._running) or bool(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_blocks(self) -> int:
        return self._free

    @property
    def kv_total_tokens(self) -> int:
        return self.profile.kv_total_tokens

    @property
    def kv_free_tokens(self) -> int:
        return self._free * self._bs

    @property
    def next_step_s(self) -> float | None:
        """Start of the next step when the engine has work (callers may start it later)."""
        return to_s(self._ready) if self.has_work else None

    def generated(self, seq_id: int) -> int:
        """Tokens sampled so far by a live sequence (KeyError once finished or aborted)."""
        s = self._seqs[seq_id]
        return s.g_base + self._G - s.G_base if s.decoding else s.generated

    def blocks_held(self) -> int:
        """Σ blocks held by running sequences, recomputed from scratch (for tests)."""
        return sum(_ceil_div(self._computed(s), self._bs) for s in self._running.values())

    # ---- requests in and out ----------------------------------------------------------
    def add(self, req: SimRequest, now: float) -> None:
        """Queue a request. A discrete-event driver calls ``advance(now)`` first."""
        if req.seq_id in self._seqs:
            raise ValueError(f"sequence {req.seq_id} is already in this engine")
        if req.prompt_tokens < 1 or req.max_output_tokens < 1:
            raise ValueError(f"sequence {req.seq_id}: prompt and output must be >= 1 token")
        if not 0 <= req.cached_tokens < req.prompt_tokens:
            raise ValueError(
                f"sequence {req.seq_id}: cached_tokens must be in [0, prompt_tokens - 1], "
                f"got {req.cached_tokens} of {req.prompt_tokens}"
            )
        if req.prompt_tokens + req.max_output_tokens > self.profile.max_seq_tokens():
            # Its KV could never fit even alone: vLLM rejects it (max_model_len); so do we.
            raise ValueError(
                f"sequence {req.seq_id}: {req.prompt_tokens}+{req.max_output_tokens} tokens "
                f"exceed the KV pool of {self.profile.kv_total_tokens} tokens"
            )
        if not self.has_work:
            self._ready = max(self._ready, to_ns(now))
        self._adds += 1
        s = _Seq(req, self._adds)
        self._seqs[req.seq_id] = s
        self._enqueue(s)

    def abort(self, seq_id: int) -> bool:
        """Drop a sequence between steps, freeing its blocks. False if unknown/done."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return False
        if seq_id in self._running:
            self._release(s)
        else:
            self._waiting.remove(s)
        return True

    # ---- stepping ------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        """Run one step starting at ``max(now, end of the previous step)``."""
        start = max(to_ns(now), self._ready)
        events: list[SeqEvent] = []
        prefill, decode = self._execute(start, events)
        end = self._ready if prefill or decode else start
        emitted: list[int] = []
        if end > start:
            # After a step every running sequence sampled a token except a partial prefill.
            tail = self._tail
            emitted = [sid for sid, s in self._running.items() if s is not tail]
            emitted += [e.seq_id for e in events if e.kind == "finished"]
        return StepResult(
            start_s=to_s(start),
            duration_s=to_s(end - start),
            prefill_tokens=prefill,
            decode_tokens=decode,
            first_tokens=tuple(e.seq_id for e in events if e.kind == "first_token"),
            finished=tuple(e.seq_id for e in events if e.kind == "finished"),
            preempted=tuple(e.seq_id for e in events if e.kind == "preempted"),
            emitted=tuple(emitted),
            events=tuple(events),
        )

    def advance(self, until: float | None) -> list[SeqEvent]:
        """Run every step that starts before ``until`` (None: until idle), jumping over
        quiet runs. The last step may end after ``until``; its events carry their times.
        Steps run back to back from the end of the previous one."""
        limit = None if until is None else to_ns(until)
        events: list[SeqEvent] = []
        while self.has_work and (limit is None or self._ready < limit):
            k = self._quiet_steps(limit)
            if k:
                self._jump(k)
                if limit is not None and self._ready >= limit:
                    break
            self._execute(self._ready, events)
        return events

    def quiet_until_s(self) -> float | None:
        """Start of the next step that can do more than decode one token per sequence
        (admit, prefill, preempt, finish), assuming nothing is added; None when idle.
        A driver may sleep until then and call ``advance`` just past it."""
        if not self.has_work:
            return None
        k = self._quiet_steps(None)
        return to_s(self._ready + k * (self._b0 + self._b2 * self._n_dec))

    # ---- internals -----------------------------------------------------------------
    def _computed(self, s: _Seq) -> int:
        if s.decoding:
            return s.prompt + s.g_base + self._G - s.G_base - 1
        return s.computed

    def _enqueue(self, s: _Seq) -> None:
        """Put ``s`` into waiting at its (priority, order) place; O(1) when it goes last."""
        waiting, key = self._waiting, (s.priority, s.order)
        if not waiting or (waiting[-1].priority, waiting[-1].order) <= key:
            waiting.append(s)
            return
        if (waiting[0].priority, waiting[0].order) > key:
            waiting.appendleft(s)
            return
        i = len(waiting)
        while i > 0 and (waiting[i - 1].priority, waiting[i - 1].order) > key:
            i -= 1
        waiting.insert(i, s)

    def _release(self, s: _Seq) -> None:
        """Take a running sequence out of every running structure and free its blocks."""
        del self._running[s.seq_id]
        self._free += _ceil_div(self._computed(s), self._bs)
        s.epoch += 1
        if s.decoding:
            s.generated = s.g_base + self._G - s.G_base
            s.decoding = False
            self._counts[s.phase] -= 1
            self._n_dec -= 1
        elif s is self._tail:
            self._tail = None

    def _preempt(
        self, start: int, events: list[SeqEvent], given: Callable[[_Seq], bool]
    ) -> _Seq:
        """Preempt the running sequence with the largest (priority, arrival). ``given``
        tells whether it was already handed a block for this step: that block, not yet in
        its computed count, goes back to the pool with the rest."""
        victim = max(self._running.values(), key=_rank)
        handed_back = given(victim)  # asked before _release clears ``decoding``
        self._release(victim)
        if handed_back:
            self._free += 1
        victim.computed = 0
        victim.cached = 0  # its shipped KV went with its blocks: recompute everything
        victim.preemptions += 1
        self.preemptions += 1
        self._enqueue(victim)  # all priorities equal: the front, as vLLM's FCFS does
        events.append(
            SeqEvent("preempted", victim.seq_id, to_s(start), victim.generated, victim.preemptions)
        )
        return victim

    def _alloc_decodes_slow(self, r: int, start: int, events: list[SeqEvent]) -> None:
        """The pool cannot give every decoding sequence of phase ``r`` its block: walk the
        running sequences in order, preempting (see :meth:`_preempt`) until each
        allocation fits or the sequence itself was the victim."""
        allocated: set[int] = set()
        for s in list(self._running.values()):
            if not s.decoding or s.phase != r:
                continue  # no new block needed, or preempted earlier in this walk
            while self._free < 1:
                if self._preempt(start, events, lambda v: v.seq_id in allocated) is s:
                    break
            else:
                self._free -= 1
                allocated.add(s.seq_id)

    def _execute(self, start: int, events: list[SeqEvent]) -> tuple[int, int]:
        """One full scheduler step at ``start``; returns (prefill, decode) tokens."""
        bs = self._bs
        r = self._G % bs
        preempted = False
        if self._counts[r] <= self._free:
            self._free -= self._counts[r]
        else:
            self._alloc_decodes_slow(r, start, events)
            preempted = True
        budget = self._max_tokens - self._n_dec
        chunks: list[tuple[_Seq, int]] = []
        tail = self._tail
        if tail is not None and budget > 0:
            c = tail.computed
            chunk = min(tail.prompt + tail.generated - c, budget)
            need = _ceil_div(c + chunk, bs) - _ceil_div(c, bs)
            while need > self._free:
                preempted = True
                # Every decoding sequence of phase r holds its block for this step by now.
                if self._preempt(start, events, lambda v: v.decoding and v.phase == r) is tail:
                    break
            else:
                self._free -= need
                chunks.append((tail, chunk))
                budget -= chunk
        n_dec = self._n_dec  # decoding sequences preempted for the tail do not step
        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(self._running) < self._max_seqs:
                head = waiting[0]
                cached = head.cached
                chunk = min(head.prompt + head.generated - cached, budget)
                need = _ceil_div(cached + chunk, bs)
                if need > self._free:
                    break  # FCFS: the head blocks the queue
                waiting.popleft()
                self._free -= need
                head.computed = cached
                self._running[head.seq_id] = head
                chunks.append((head, chunk))
                budget -= chunk
        prefill = sum(chunk for _, chunk in chunks)
        if not chunks and n_dec == 0:
            return 0, 0  # everything was preempted; the next step re-admits
        duration = self._b0 + self._b1 * prefill + self._b2 * n_dec
        end = start + duration
        self._ready = end
        self._G += 1
        self.steps += 1
        self.prefill_tokens += prefill
        self.decode_tokens += n_dec
        self.busy_ns += duration
        t_end = to_s(end)
        for s, chunk in chunks:
            self._finish_chunk(s, chunk, t_end, events)
        self._pop_finished(t_end, events)
        return prefill, n_dec

    def _finish_chunk(self, s: _Seq, chunk: int, t_end: float, events: list[SeqEvent]) -> None:
        s.computed += chunk
        if s.computed < s.prompt + s.generated:
            self._tail = s
            return
        if s is self._tail:
            self._tail = None
        s.generated += 1
        if s.generated == 1:
            events.append(SeqEvent("first_token", s.seq_id, t_end, 1, s.preemptions))
        if s.generated >= s.target:
            self._finish(s, t_end, events)
            return
        G = self._G
        s.decoding = True
        s.g_base = s.generated
        s.G_base = G
        s.phase = (G - s.computed) % self._bs
        self._counts[s.phase] += 1
        self._n_dec += 1
        self._pushes += 1
        heapq.heappush(self._heap, (G + s.target - s.generated, self._pushes, s.epoch, s))

    def _pop_finished(self, t_end: float, events: list[SeqEvent]) -> None:
        heap, G = self._heap, self._G
        while heap and heap[0][0] <= G:
            _, _, epoch, s = heapq.heappop(heap)
            if epoch == s.epoch:
                self._finish(s, t_end, events)

    def _finish(self, s: _Seq, t_end: float, events: list[SeqEvent]) -> None:
        self._release(s)
        del self._seqs[s.seq_id]
        events.append(SeqEvent("finished", s.seq_id, t_end, s.generated, s.preemptions))

    def _next_finish_G(self) -> int | None:
        heap = self._heap
        while heap and heap[0][2] != heap[0][3].epoch:
            heapq.heappop(heap)  # stale: the sequence was preempted or aborted
        return heap[0][0] if heap else None

    def _quiet_steps(self, limit: int | None) -> int:
        """How many upcoming steps are quiet (see module docstring) and start before
        ``limit``. Each condition below is one way a step stops being quiet."""
        n = self._n_dec
        if self._tail is not None or n == 0:
            return 0
        finish_G = self._next_finish_G()
        assert finish_G is not None  # n > 0 decoding sequences each have a live entry
        k = finish_G - self._G - 1  # the finishing step itself is not quiet
        if k <= 0:
            return 0
        bs, counts, free = self._bs, self._counts, self._free
        G0 = self._G % bs
        free_after_first = free - counts[G0]
        if free_after_first < 0:
            return 0  # the very next step preempts
        if self._waiting and n < self._max_seqs:
            head = self._waiting[0]
            chunk = min(head.prompt + head.generated - head.cached, self._max_tokens - n)
            if _ceil_div(head.cached + chunk, bs) <= free_after_first:
                return 0  # the head is admitted next step; free blocks only shrink later
        # Steps before the pool runs dry: each B-step cycle takes exactly one block per
        # sequence, then walk the phases of the last partial cycle.
        cycles, rem = divmod(free, n)
        j = 0
        while counts[(G0 + j) % bs] <= rem:
            rem -= counts[(G0 + j) % bs]
            j += 1
        k = min(k, cycles * bs + j)
        if limit is not None:
            d = self._b0 + self._b2 * n
            k = min(k, max(0, _ceil_div(limit - self._ready, d)))
        return k

    def _jump(self, k: int) -> None:
        """Apply ``k`` quiet steps at once: identical to k calls of ``_execute``."""
        bs, n, counts = self._bs, self._n_dec, self._counts
        G0 = self._G % bs
        used = (k // bs) * n + sum(counts[(G0 + j) % bs] for j in range(k % bs))
        d = self._b0 + self._b2 * n
        self._free -= used
        self._G += k
        self._ready += k * d
        self.steps += k
        self.decode_tokens += k * n
        self.busy_ns += k * d
