"""The samples of a step that only add a token, taken as columns: most of a step's samples
(FastSequence.quiet_below: the first token already sent, no block to publish, the length bound
not reached, a token sink to take it) that are no running request's stop token. Each list
operation is a map in C; the others go the long way, one by one (FastSteps.take)."""

from __future__ import annotations

import collections
import itertools
import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.steps.fast_steps import FastSequence as Sequence


def quiet_samples(seqs: list[Sequence], token_ids: list[int],
                  stop_ids: dict[int, int]) -> list[bool]:
    """Which samples (token_ids[i] for seqs[i]) only add a token."""
    quiet = list(map(operator.lt, map(len, map(_token_ids, seqs)), map(_quiet_below, seqs)))
    if not stop_ids.keys().isdisjoint(token_ids):
        quiet = list(map(operator.gt, quiet, map(stop_ids.__contains__, token_ids)))
    return quiet


def take_quiet(seqs: list[Sequence], token_ids: list[int], logprobs: list[float]) -> None:
    """Samples that only add a token: appended to their sequences' and requests' tokens and
    handed to their requests' sinks as columns."""
    if not seqs:
        return
    collections.deque(map(list.append, map(_token_ids, seqs), token_ids), maxlen=0)
    collections.deque(map(list.append, map(_output_ids, seqs), token_ids), maxlen=0)
    sinks = list(map(_sink, seqs))
    ids = list(map(_sink_id, seqs))
    if sinks.count(sinks[0]) == len(sinks):  # (one Stream connection: the usual case)
        sinks[0].add(ids, token_ids, logprobs)
        return
    for sink in set(sinks):
        mine = list(map(operator.is_, sinks, itertools.repeat(sink)))
        sink.add(itertools.compress(ids, mine), itertools.compress(token_ids, mine),
                 itertools.compress(logprobs, mine))


_token_ids = operator.attrgetter("token_ids")
_output_ids = operator.attrgetter("output_ids")
_quiet_below = operator.attrgetter("quiet_below")
_sink = operator.attrgetter("sink")
_sink_id = operator.attrgetter("sink_id")
