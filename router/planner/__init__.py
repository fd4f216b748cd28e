"""The SLO planner: sizes the prefill and decode pools from what the router measures.

Every `interval_s` the router takes a `Snapshot` (`snapshot.py`) of what it saw since
the last one: arrivals and prompt work, first tokens and times per output token, each
pool's size and queues, and what the workers' replies say of their speed. The planner
is a pure function of that snapshot and its own state (`policy.plan`):

1. `capacity.py` fits each pool's speed from the workers' reports: a prefill worker's
   busy time against the prompts it ran (per prompt, per token, per token squared), a
   decode step's time against its batch size and context.
2. `demand.py` turns the recent traffic into each pool's load, in busy workers at the
   utilisation the targets allow, and reads the measured attainment of the TTFT and
   TPOT targets.
3. `policy.py` decides both pools' sizes together within the worker budget: at most one
   worker more or fewer per pool per interval unless a target is badly missed, a
   cool-down after each change, no worker added for a burst shorter than a worker's
   start-up, and a pool shrinks only after it has been over-provisioned for a cool-down.

`loop.py` runs it against the live pools (growing and draining through `Pools.scale`,
as `pdserve scale` does), `signals.py` is what the serving core records for it, and
`metrics.py` exports its decisions. No Ray or gRPC below `loop.py`.
"""
