"""`BlockingLinkEnd`: a lane link end's calls for the trainer's worker thread (a node.train.lane.Boundary).

Tensors are encoded and decoded here, in the calling thread (swarm/lane/payload.py); only bytes cross to the event
loop, one call per message (`trio.from_thread.run`), as the collective's blocking exchange does for the
synchronizers. `crossings` counts the calls into the loop (each one crosses there and back)."""

from __future__ import annotations

import functools
import logging

import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.lane import BWD, FWD, TRAIN
from shoal.swarm.lane.end import LinkEnd
from shoal.swarm.lane.payload import decode_acts, decode_grads, encode_acts, encode_grads

log = logging.getLogger(__name__)


class BlockingLinkEnd:
    """A LinkEnd's calls from the trainer's worker thread (a node.train.lane.Boundary): each one encodes or decodes
    here, runs the message's transfer on the event loop through `trio.from_thread.run` and blocks until it is done;
    `abort` never raises."""

    def __init__(self, end: LinkEnd, trio_token: trio.lowlevel.TrioToken):
        self.end, self.trio_token = end, trio_token
        self.crossings = 0  # calls into the event loop

    def _run(self, fn, *args, **kw):
        self.crossings += 1
        return trio.from_thread.run(functools.partial(fn, *args, **kw), trio_token=self.trio_token)

    def send_act(self, step, micro, ids, acts_BTD, *, phase=TRAIN):
        out = encode_acts(self.end.spec, self.end.aq_out, step, micro, ids, acts_BTD, phase)
        self.end.seal(FWD, step, micro, out, acts_BTD, phase=phase)  # a verified run's: signed here too
        self._run(self.end.post_act, step, micro, out, phase=phase)

    def recv_act(self, step, micro, *, phase=TRAIN):
        end = self.end
        while True:
            rec, frames = self._run(end.take_act, step, micro, phase=phase)
            try:
                got = decode_acts(end.spec, end.aq_in, rec, frames, step)
            except ProtocolError as e:
                raise self._run(end.refuse, FWD, str(e), step) from None
            if isinstance(got, tuple):
                why = end.unseal(FWD, rec, got[1])
                if why is not None:
                    raise self._run(end.refuse, FWD, why, step)
                return got
            self._run(end.nack, rec, got)

    def send_grad(self, step, micro, grad_BTD):
        out = self.end.seal(BWD, step, micro, encode_grads(self.end.spec, grad_BTD), grad_BTD)
        self._run(self.end.post_grad, step, micro, out)

    def recv_grad(self, step, micro):
        rec, frame = self._run(self.end.take_grad, step, micro)
        try:
            g = decode_grads(self.end.spec, frame)
        except ProtocolError as e:
            raise self._run(self.end.refuse, BWD, str(e), step) from None
        why = self.end.unseal(BWD, rec, g)
        if why is not None:
            raise self._run(self.end.refuse, BWD, why, step)
        return g

    def exchange_norms(self, step, norms, finite):
        return self._run(self.end.exchange_norms, step, norms, finite)

    def abort(self, step, reason, *, phase=TRAIN):
        try:
            self._run(self.end.abort, step, reason, phase=phase)
        except Exception as e:  # noqa: BLE001 - the loop is shutting down: nothing left to tell
            log.debug("abort of step %d not delivered: %s", step, e)
