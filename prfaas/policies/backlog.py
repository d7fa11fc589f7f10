"""Predicted prefill backlog per instance: the seconds of work the gateway has sent there.

Mooncake's conductor predicts each prefill instance's queue from what it dispatched (and
the profile's prefill time for each request) instead of reading the instance's current
queue: engine reports lag, so deciding on them sends a burst to whichever pool looked idle
a moment ago. Each instance is modelled as a FIFO server: its requests run one after the
other in the order they were sent, each for its predicted seconds, the head from the later
of its dispatch and the previous request's end. A request's real end replaces its
prediction, so errors in the profile never accumulate.

A pure data structure: times are passed in (the caller reads its loop's clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Queue:
    predicted: dict[str, float] = field(default_factory=dict)
    """rid -> predicted seconds, in dispatch order (dicts keep insertion order)."""
    head_start: float = 0.0
    """When the current head started (its dispatch, or the previous request's end)."""
    total_s: float = 0.0


class BacklogLedger:
    """The predicted queue of every prefill instance. Mutated by `admit` and `finish`."""

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}

    def admit(self, instance_id: str, rid: str, predicted_s: float, now: float) -> None:
        """Request `rid`, predicted to take `predicted_s`, was sent to `instance_id` at `now`.

        Raises:
            ValueError: `rid` is already in flight on that instance.
        """
        queue = self._queues.get(instance_id)
        if queue is None:
            queue = self._queues[instance_id] = _Queue(head_start=now)
        if rid in queue.predicted:
            raise ValueError(f"request {rid!r} is already queued on {instance_id}")
        seconds = max(predicted_s, 0.0)
        queue.predicted[rid] = seconds
        queue.total_s += seconds

    def finish(self, instance_id: str, rid: str, now: float) -> None:
        """Request `rid` ended on `instance_id` at `now` (well or not; unknown: ignored).
        When the head ends, the next request starts now."""
        queue = self._queues.get(instance_id)
        if queue is None or rid not in queue.predicted:
            return
        was_head = next(iter(queue.predicted)) == rid
        queue.total_s -= queue.predicted.pop(rid)
        if not queue.predicted:
            del self._queues[instance_id]
        elif was_head:
            queue.head_start = now

    def backlog(self, instance_id: str, now: float) -> float:
        """Predicted seconds until `instance_id` could start a new prefill (0: idle)."""
        queue = self._queues.get(instance_id)
        if queue is None:
            return 0.0
        head = next(iter(queue.predicted.values()))
        head_left = max(head - (now - queue.head_start), 0.0)
        return max(queue.total_s - head + head_left, 0.0)

    def backlogs(self, now: float) -> dict[str, float]:
        """`backlog` of every instance with work in flight."""
        return {i: self.backlog(i, now) for i in self._queues}

    def in_flight(self, instance_id: str) -> int:
        queue = self._queues.get(instance_id)
        return 0 if queue is None else len(queue.predicted)

    def forget(self, instance_id: str) -> None:
        """Drop an instance's queue (it restarted, left, or changed role)."""
        self._queues.pop(instance_id, None)


def merged_backlogs(
    own: dict[str, float], others: list[tuple[dict[str, float], float]]
) -> dict[str, float]:
    """Each instance's backlog as all gateways booked it: this gateway's `own` plus each
    other's reported backlog, less the seconds since it was reported (an instance works
    its queue off at one second per second). `others`: (backlog per instance, its age in
    seconds). The sum treats the replicas' queues on one instance as one FIFO."""
    merged = dict(own)
    for backlog, age in others:
        for instance, seconds in backlog.items():
            left = seconds - max(age, 0.0)
            if left > 0:
                merged[instance] = merged.get(instance, 0.0) + left
    return merged
