"""Leadership hooks: ``on_leader_elected`` / ``on_leader_lost`` shell commands.

The command runs through the shell with the node's environment plus
``SKRED_NODE_ID``, ``SKRED_ADVERTISED_URI`` and ``SKRED_ROLE`` (``leader`` or
``follower``), and ``SKRED_SHARD`` (the vhost) for a shard's own leadership
(``[clustering] shard_leaders``). Its exit status is logged; a hook that hangs is killed after
``HOOK_TIMEOUT`` so it can never block a failover.

The child is started with ``posix_spawn`` (``subprocess`` picks it for an
absolute executable with ``close_fds=False`` and nothing to run in between),
never with a plain ``fork()``: the etcd client's gRPC threads register fork
handlers, and a child forked while they are busy can crash before it execs
(we saw hooks die with SIGSEGV). Python opens every descriptor close-on-exec,
so ``close_fds=False`` leaks nothing. The wait runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess

log = logging.getLogger(__name__)

HOOK_TIMEOUT = 30.0


async def run_hook(command: str, node_id: str, uri: str, role: str, shard: str | None = None) -> int | None:
    """Run ``command`` (no-op when empty); returns its exit status, None if not run."""
    if not command:
        return None
    env = dict(os.environ, SKRED_NODE_ID=node_id, SKRED_ADVERTISED_URI=uri, SKRED_ROLE=role)
    if shard is not None:
        env["SKRED_SHARD"] = shard
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], env=env, close_fds=False,
                                stdin=subprocess.DEVNULL)
    except OSError as exc:
        log.error("hook %r could not start: %s", command, exc)
        return None
    loop = asyncio.get_running_loop()
    try:
        code = await loop.run_in_executor(None, proc.wait, HOOK_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        await loop.run_in_executor(None, proc.wait)
        log.error("hook %r killed after %.0fs", command, HOOK_TIMEOUT)
        return None
    log.log(logging.INFO if code == 0 else logging.ERROR, "hook %r (%s) exited with %d", command, role, code)
    return code
