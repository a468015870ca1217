"""`BlockingLinkEnd`: a lane link end's calls for the trainer's worker thread (a node.train.lane.Boundary)."""

from __future__ import annotations

import functools
import logging

import trio

from shoal.protocol.lane import TRAIN
from shoal.swarm.lane.end import LinkEnd

log = logging.getLogger(__name__)


class BlockingLinkEnd:
    """A LinkEnd's calls from the trainer's worker thread (a node.train.lane.Boundary): each one runs on the event
    loop through `trio.from_thread.run` and blocks until it is done; `abort` never raises."""

    def __init__(self, end: LinkEnd, trio_token: trio.lowlevel.TrioToken):
        self.end, self.trio_token = end, trio_token

    def _run(self, fn, *args, **kw):
        return trio.from_thread.run(functools.partial(fn, *args, **kw), trio_token=self.trio_token)

    def send_act(self, step, micro, ids, acts_BTD, *, phase=TRAIN):
        self._run(self.end.send_act, step, micro, ids, acts_BTD, phase=phase)

    def recv_act(self, step, micro, *, phase=TRAIN):
        return self._run(self.end.recv_act, step, micro, phase=phase)

    def send_grad(self, step, micro, grad_BTD):
        self._run(self.end.send_grad, step, micro, grad_BTD)

    def recv_grad(self, step, micro):
        return self._run(self.end.recv_grad, step, micro)

    def exchange_norms(self, step, norms, finite):
        return self._run(self.end.exchange_norms, step, norms, finite)

    def abort(self, step, reason, *, phase=TRAIN):
        try:
            self._run(self.end.abort, step, reason, phase=phase)
        except Exception as e:  # noqa: BLE001 - the loop is shutting down: nothing left to tell
            log.debug("abort of step %d not delivered: %s", step, e)
