"""Every decision about a job, as pure functions: (record(s), request, now) -> Change or None.

No function here does I/O or reads a clock; the stores read, call one of these, and write
what it returns by compare-and-set (`service.store.cas`), calling it again on a lost race.
So each is tested with a table of cases and a fixed `now` (tests/service/test_decide_*.py).

    state.py       the job state machine: which moves are allowed, and the event of each
    outcome.py     when a job ends: succeeded, failed by a member, failed by its restarts
    scheduling.py  which nodes a job gets, and what becomes of it when nodes come and go
    order.py       the order in which waiting jobs are offered nodes (priority, then age)
    preempt.py     which running jobs of lower priority give nodes to a waiting one, and how
    keep.py        the nodes that hold a waiting job's memory copy: offered to it first, held from others
    rounds.py      what a rendezvous round means: a restart (counted) or a membership change
    members.py     a node's report on its workers, and the registration of a node that held work
    cancel.py      cancel
    snapshots.py   snapshot commits and corrupt reports, progress, rank 0's control request
"""
