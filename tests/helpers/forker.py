"""A clean interpreter per test without paying its start-up each time: this process imports what every in-process
swarm test needs (torch, py-libp2p, trio, pytest and shoal's node: ~5 s on 2 cores), runs nothing else, and forks one
child per test, which runs pytest on that test's node id. Each child starts from this never-used state (no threads,
sockets or py-libp2p caches left by earlier tests), as a fresh interpreter would; its `random` and numpy generators
are re-seeded from the OS, as a fresh interpreter's are.

Protocol (the parent is tests/conftest.py): one JSON line per test on stdin, {"args": [...], "out": path}; this
process answers {"pid": child} when the child starts and {"code": exit code} when it ends; the child's stdout and
stderr go to `out`. The process must stay single-threaded between forks (torch's import starts one helper thread of
its own; forking after the import is what torch's fork-based data loaders do)."""

from __future__ import annotations

import json
import os
import random
import sys
import traceback


def _child(args: list[str], out: str) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    random.seed()
    import numpy

    numpy.random.seed()
    import pytest

    code = 3
    try:
        code = int(pytest.main(args))
    except BaseException:  # noqa: BLE001 - told in the output, as a fresh interpreter would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    import hypothesis  # noqa: F401
    import libp2p  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - torch.optim imports it at an optimizer's first use: 1.7 s of a core a child
    import trio  # noqa: F401

    import shoal.node.daemon  # noqa: F401
    import shoal.node.run.runtime  # noqa: F401

    answer = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(list(req["args"]), str(req["out"]))
        answer.write(json.dumps({"pid": pid}) + "\n")
        answer.flush()
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
