"""The scheduler's pure core: snapshot types, pending queue, lanes, ledger, the cycle.

Owns the data the scheduler decides over (:mod:`.types`), the pending queue with aging
(:mod:`.queue`) and lane turns (:mod:`.lanes`), the drain meter (:mod:`.drain`), the
reservation ledger (:mod:`.ledger`, :mod:`.affinity`), candidate indexes (:mod:`.index`),
the scheduling cycle (:mod:`.cycle`, choosing among class heads with :mod:`.heads`) and
worker-loss recovery (:mod:`.recovery`).

Who may call it: the scheduler service's agents and the simulator. Pure: no Kafka, Faust,
Consul, vLLM, pynvml or pydantic import, no I/O, no env reads; ``now`` and the RNG come in
as arguments. :class:`PendingQueue` and :class:`Ledger` are plain state classes: exactly one
owner mutates them, synchronously. Import the public names from :mod:`services.scheduler`.
"""
