"""The dual-timescale schedulers' loops (their pure cores are in `prfaas.policies`).

`Scheduler` (scheduler.py) owns them: the request-path hook (observer.py: predicted backlog,
the load forecast for conditional disaggregation, the period's samples), the short-term loop
(short_term.py: trims `t`, chooses the regime, every tick), the long-term loop (long_term.py:
estimates the workload, re-solves the set-point, converts roles, every period), the role
conversions (roles.py: drain, then the engine's role API), and the one decision value they
publish (decisions.py: `ScheduleState`, applied to the Router and the instance registry,
logged and counted). Every loop reads the event loop's clock, so the simulator runs them
unchanged on virtual time.
"""
