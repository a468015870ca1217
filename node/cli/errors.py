"""The `shoal` command's expected errors: one line with a hint and a distinct exit code each, never a traceback."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """Exit statuses of every `shoal` command (README "Exit codes"; `shoal --help`)."""

    OK = 0
    FAILED = 1  # an unexpected error (a bug): -v shows the traceback
    USAGE = 2  # bad arguments or a bad input file
    JOIN_UNREACHABLE = 3  # no --join address answered
    UNKNOWN_RUN = 4  # no peer of the swarm knows the run
    SECRET = 5  # the run is private: join secret missing or wrong
    NOT_ADMITTED = 6  # the broker refused admission for another reason (allowlist)
    IDENTITY_UNUSABLE = 7  # the identity file is corrupt or unreadable
    IDENTITY_IN_USE = 8  # another node runs with this identity (here or in the swarm)
    NO_DEVICE = 9  # the asked-for device (cuda, mps) is not available
    DOES_NOT_FIT = 10  # the run's stage does not fit in the device's free memory
    ADDRESS_IN_USE = 11  # the --listen port is taken
    INPUTS_UNAVAILABLE = 12  # the run's data, model files or a package they need cannot be had here
    INTERRUPTED = 130  # Ctrl+C (or SIGTERM/SIGHUP) before the node was up


HINTS: dict[Exit, str] = {
    Exit.JOIN_UNREACHABLE: "check that the node at that address runs and that its port is reachable from here "
                           "(shoal doctor --join ADDR)",
    Exit.UNKNOWN_RUN: "shoal runs --join ADDR lists the runs the swarm advertises (name, id); or pass the run's "
                      "manifest file",
    Exit.SECRET: "pass the run's join secret with --secret or SHOAL_JOIN_SECRET (the run owner's node too)",
    Exit.NOT_ADMITTED: "ask the run's owner to admit this node's peer id",
    Exit.IDENTITY_UNUSABLE: "point --identity at a good key file, or move this one away to start with a new "
                            "identity (a new peer id)",
    Exit.IDENTITY_IN_USE: "stop the other node, or give this one its own --identity FILE",
    Exit.NO_DEVICE: "use --device auto or cpu (shoal doctor lists the devices torch sees)",
    Exit.DOES_NOT_FIT: "free memory on the device, use a bigger one, or join a run with a smaller model",
    Exit.ADDRESS_IN_USE: "choose another port in --listen, or port 0 for any free one",
}

#: exception classes (module.qualname, anywhere in the exception's MRO) that are expected errors, by exit status;
#: named rather than imported so that classifying an error never imports libp2p or torch. An error raised anywhere
#: in a node's task tree (the runtime, the trainer's thread, a nursery's child) is found inside the exception groups
#: it reaches the top in (node/failure.py): to make a new failure expected, name its class here (and its hint below
#: when the exit status's hint does not fit it).
EXPECTED: dict[str, Exit] = {
    "shoal.swarm.net.host.JoinError": Exit.JOIN_UNREACHABLE,
    "shoal.node.run.preflight.UnknownRun": Exit.UNKNOWN_RUN,
    "shoal.node.run.preflight.UntrustedData": Exit.USAGE,
    "shoal.node.run.resolve.AmbiguousRun": Exit.USAGE,
    "shoal.swarm.run.broker.AdmissionError": Exit.NOT_ADMITTED,  # SECRET when it is about the secret
    "shoal.swarm.net.identity.IdentityError": Exit.IDENTITY_UNUSABLE,
    "shoal.node.identity_lock.IdentityInUse": Exit.IDENTITY_IN_USE,
    "shoal.node.twins.TwinDetected": Exit.IDENTITY_IN_USE,
    "shoal.node.train.device.DeviceUnavailable": Exit.NO_DEVICE,
    "shoal.node.run.preflight.DoesNotFit": Exit.DOES_NOT_FIT,
    "shoal.swarm.net.listen.AddressInUse": Exit.ADDRESS_IN_USE,
    "shoal.node.run.runtime.ResumeError": Exit.USAGE,
    "shoal.node.train.datacheck.DataUnavailable": Exit.INPUTS_UNAVAILABLE,
    "shoal.node.train.optional.MissingPackage": Exit.INPUTS_UNAVAILABLE,
    "shoal.node.train.tokens.MissingTokenizers": Exit.INPUTS_UNAVAILABLE,
    "shoal.swarm.state.blobs.BlobError": Exit.INPUTS_UNAVAILABLE,
}

#: hints for expected errors whose exit status's hint (HINTS) says too little, by class as in EXPECTED
CLASS_HINTS: dict[str, str] = {
    "shoal.node.run.preflight.UntrustedData": "give this node its copy of the run's data with --data PATH",
    "shoal.node.run.runtime.ResumeError": "name the folder a run's checkpoints are in (its nodes' --checkpoint-dir)",
    "shoal.node.run.preflight.NotTheOwner": "start the run's first node with the identity that signed it "
                                            "(--identity KEY), or sign the run with this node's: shoal run create "
                                            "--identity KEY; other nodes join it with --join ADDR --run RUN_ID",
}


class CliError(Exception):
    """An expected error: what happened, the exit status, and (by default) the status's hint."""

    def __init__(self, message: str, code: Exit = Exit.USAGE, hint: str | None = None):
        super().__init__(message)
        self.message, self.code = message, code
        self.hint = hint if hint is not None else HINTS.get(code, "")

    def line(self, prog: str) -> str:
        text = " ".join(f"{prog}: {self.message}".split())  # one line, whatever the message held
        return f"{text}; hint: {self.hint}" if self.hint else text


def _names(exc: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}


def _expected(e: BaseException) -> CliError | None:
    if isinstance(e, CliError):
        return e
    if isinstance(e, KeyboardInterrupt):
        return CliError("interrupted", Exit.INTERRUPTED, hint="")
    names = _names(e)
    name = next((n for n in names if n in EXPECTED), None)
    if name is None:
        return None
    code = EXPECTED[name]
    if code is Exit.NOT_ADMITTED and "secret" in str(e):
        code = Exit.SECRET
    return CliError(str(e) or type(e).__name__, code, hint=next((CLASS_HINTS[n] for n in names if n in CLASS_HINTS),
                                                                 None))


def is_expected(e: BaseException) -> bool:
    return _expected(e) is not None


def classify(exc: BaseException) -> CliError | None:
    """The expected error `exc` stands for, looking inside exception groups (node/failure.py), or None for a bug.

    Cancellations are side effects; an expected error wins over anything beside it (the errors its failure caused
    in the tasks around it), and an interruption over unexpected ones (a task torn down mid-way by Ctrl+C)."""
    from shoal.node.failure import cause, leaves

    found = _expected(cause(exc, prefer=lambda e: is_expected(e) and not isinstance(e, KeyboardInterrupt)))
    if found is None and any(isinstance(e, KeyboardInterrupt) for e in leaves(exc)):
        return _expected(KeyboardInterrupt())
    return found


def exit_codes_text() -> str:
    """The exit statuses as `--help` and the README list them."""
    lines = ["exit status:"]
    for code in Exit:
        comment = _COMMENTS[code]
        lines.append(f"  {int(code):>3}  {comment}")
    return "\n".join(lines)


_COMMENTS: dict[Exit, str] = {
    Exit.OK: "done (a node that was up and left on Ctrl+C/SIGTERM included)",
    Exit.FAILED: "an unexpected error (a bug): run again with -v for the traceback",
    Exit.USAGE: "bad arguments or a bad input file",
    Exit.JOIN_UNREACHABLE: "no --join address answered",
    Exit.UNKNOWN_RUN: "no run of the swarm has the --run name or id (prefix)",
    Exit.SECRET: "the run is private: join secret missing or wrong",
    Exit.NOT_ADMITTED: "the run's broker refused this node (allowlist)",
    Exit.IDENTITY_UNUSABLE: "the identity file is corrupt or unreadable",
    Exit.IDENTITY_IN_USE: "another node runs with this identity, on this machine or in the swarm",
    Exit.NO_DEVICE: "the device asked for (--device cuda, mps) is not available",
    Exit.DOES_NOT_FIT: "the run's model does not fit in the device's free memory",
    Exit.ADDRESS_IN_USE: "the --listen port is already in use",
    Exit.INPUTS_UNAVAILABLE: "the run's data, model files or a package they need cannot be had on this machine",
    Exit.INTERRUPTED: "interrupted (Ctrl+C, SIGTERM or SIGHUP) before the node was up",
}
