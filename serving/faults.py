"""Failures of a round: what a client gets (`round_failure`), and faults injected for tests.

A round that raises fails the requests riding in it, and any admitted since, which share the
device state it lost (the scheduler's `_round_failed`). What they are told depends on the
error: a device out of memory (XLA's RESOURCE_EXHAUSTED) is a 503, the load's fault rather
than the request's or a bug, and retrying later may succeed; anything else is a 500.

Injected faults are test-only and sit behind the project's one debug hook,
`$JAXLLM_DEBUG_KERNELS` (see `jaxllm.model.kernel_choice`): with `faults=on` in it, a round
carrying a request whose `user` field is `jaxllm-fault:error` fails as a compiled round that
raises does (its donated device state deleted, a RuntimeError), and one whose `user` is
`jaxllm-fault:oom` raises the XlaRuntimeError that XLA raises when the device runs out of
memory. Without `faults=on` the `user` field means nothing to the server.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

from jaxllm.model.kernel_choice import DEBUG_ENV

FAULT_USERS = {"jaxllm-fault:error": "error", "jaxllm-fault:oom": "oom"}
OOM_MESSAGE = (
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate the round's buffers (injected by the faults debug hook)"
)


def round_failure(e: BaseException) -> tuple[int, str]:
    """The status and message for the requests of a round that raised `e`."""
    if "RESOURCE_EXHAUSTED" in str(e):
        return 503, (
            "the device ran out of memory running this request's round; retry later, or with a smaller max_tokens or n"
        )
    return 500, f"internal error in the model step: {e}"[:1000]


@functools.cache
def _faults_on(text: str) -> bool:
    items = (part.strip().partition("=") for part in text.split(","))
    return any(name.strip() == "faults" and value.strip() == "on" for name, _, value in items)


def inject(members: Iterable[tuple[Any, Any]], engine: Any) -> None:
    """Fails the round about to launch as a compiled round that raises would, if one of its
    requests asks for a fault (test-only; see the module doc): the engine's device state,
    which the round is given by donation, is deleted, and the error raised. (A jitted step
    whose host callback raises leaves its donated state deleted exactly so, on the CPU.)

    Args:
      members: the round's (Active, Choice) pairs, as the scheduler keeps them.
      engine: the `jaxllm.engine.Engine` whose state the round would consume.
    """
    if not _faults_on(os.environ.get(DEBUG_ENV, "")):
        return
    kinds = {FAULT_USERS.get(a.job.prepared.user or "") for a, _ in members} - {None}
    if not kinds:
        return
    import jax

    for leaf in jax.tree.leaves(engine.state):
        leaf.delete()
    if "oom" in kinds:
        raise jax.errors.JaxRuntimeError(OOM_MESSAGE)
    raise RuntimeError("injected fault in a compiled round (the faults debug hook)")
