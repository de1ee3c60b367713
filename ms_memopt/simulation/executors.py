"""Run independent tasks on local processes or on an existing distributed engine.

The job simulator (:mod:`ms_memopt.simulation.job`) and sweeps hand every rank stream to one function,
:func:`run_tasks`, which runs them

* ``"local"`` (the default): embedded worker processes on this machine, one per core
  (:class:`concurrent.futures.ProcessPoolExecutor`); one task, or ``workers=1``, runs inline;
* ``"dask"``: on a Dask distributed cluster — the scheduler at ``address``
  (``tcp://host:8786``), or, with no address, Dask's own local cluster on this machine
  (``distributed.LocalCluster``; ``processes=False`` keeps its workers as threads of this
  process, which CI uses to test the engine path without starting processes);
* ``"ray"``: on a Ray cluster (``ray.init(address=...)``: ``host:6379`` from a node of the
  cluster, ``ray://head:10001`` through Ray Client); no address starts Ray's local mode on
  this machine (``ray.init("local", num_cpus=workers, include_dashboard=False)``), and a Ray this
  process already initialised is used as it is and left running.

Nothing here schedules: each engine does. Results come back in task order whatever order
tasks finish in, so a run gives the same answer on every executor, and a failing task raises
its own exception on every executor. Task functions must be importable by the workers
(module-level functions of an installed ``ms_memopt``, or builtins).

A task may report how far it got with :func:`report_progress` (a step of a simulation): the
counts reach ``run_tasks``' ``on_progress`` in this process while the tasks run (local processes
and inline runs; Dask and Ray report finished tasks only). Ctrl-C stops a local run cleanly: the
tasks not started are cancelled, the workers stopped and the pool shut down (no stray processes,
no leaked semaphores), and ``KeyboardInterrupt`` reaches the caller.

Example:
    >>> run_tasks(abs, [-2, 3, -5], executor="local", workers=1)
    [2, 3, 5]
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from ms_memopt.core.errors import InputError

__all__ = ["EXECUTORS", "Background", "default_workers", "report_progress", "run_tasks", "start_task"]

#: the ``--executor`` choices
EXECUTORS = ("local", "dask", "ray")

#: where :func:`report_progress` sends its counts in this process: a shared counter (a local
#: worker process), the caller's ``on_progress`` (inline runs), or nowhere
_progress_sink: Callable[[int], None] | None = None
#: seconds between two reads of the workers' shared progress counter
_POLL_SECONDS = 0.5


def report_progress(units: int = 1) -> None:
    """Called by a task: ``units`` more of its work are done (:func:`run_tasks`' ``on_progress``);
    a no-op where nobody listens."""
    if _progress_sink is not None:
        _progress_sink(units)


def default_workers() -> int:
    """Cores this process may use (``os.sched_getaffinity`` where the OS has it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # macOS, Windows
        return max(1, os.cpu_count() or 1)


def run_tasks(fn: Callable[[Any], Any], tasks: Sequence[Any], *, executor: str = "local",
              address: str | None = None, workers: int | None = None,
              on_done: Callable[[int, Any], None] | None = None, processes: bool = True,
              on_progress: Callable[[int], None] | None = None) -> list:
    """``[fn(task) for task in tasks]``, run in parallel on ``executor``.

    Args:
        fn: a module-level function (it is pickled by reference).
        tasks: its arguments, one per task (picklable).
        executor: ``"local"``, ``"dask"`` or ``"ray"``.
        address: the cluster to join (dask: the scheduler address; ray: ``ray.init``'s);
            ``None`` starts the engine's local mode on this machine. Not used by ``"local"``.
        workers: worker processes (default: every core) for ``"local"`` and the engines'
            local modes.
        on_done: called as ``on_done(index, result)`` when a task finishes (in finishing order;
            progress bars).
        processes: ``False`` runs Dask's local cluster on threads of this process (tests).
        on_progress: called in this process as ``on_progress(units)`` with the units the tasks
            reported (:func:`report_progress`) since the last call (local and inline runs).

    Returns:
        the results in task order.

    Raises:
        InputError: an unknown executor, an engine that is not installed, or a cluster that
            cannot be reached (CLI exit code 2).
    """
    if executor not in EXECUTORS:
        raise InputError(f"unknown executor {executor!r}; expected one of {', '.join(EXECUTORS)}",
                         key="--executor")
    if address is not None and executor == "local":
        raise InputError("--address names a Dask or Ray cluster; add --executor dask or --executor ray",
                         key="--address")
    tasks = list(tasks)
    workers = max(1, workers or default_workers())
    results: list = [None] * len(tasks)

    def done(index: int, value: Any) -> None:
        results[index] = value
        if on_done is not None:
            on_done(index, value)

    if not tasks:
        return results
    if executor == "local":
        _run_local(fn, tasks, workers, done, on_progress)
    elif executor == "dask":
        _run_dask(fn, tasks, address, workers, processes, done)
    else:
        _run_ray(fn, tasks, address, workers, done)
    return results


def _run_local(fn, tasks: list, workers: int, done: Callable[[int, Any], None],
               on_progress: Callable[[int], None] | None = None) -> None:
    global _progress_sink
    if workers == 1 or len(tasks) == 1:
        _progress_sink = on_progress
        try:
            for index, task in enumerate(tasks):
                done(index, fn(task))
        finally:
            _progress_sink = None
        return
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = _context()
    counter = context.Value("q", 0)
    pool = ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=context,
                               initializer=_init_worker, initargs=(counter,))
    reported = 0

    def poll() -> None:
        nonlocal reported
        value = counter.value
        if on_progress is not None and value > reported:
            on_progress(value - reported)
        reported = value

    try:
        futures = {pool.submit(fn, task): index for index, task in enumerate(tasks)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=_POLL_SECONDS, return_when=FIRST_COMPLETED)
            poll()
            for future in finished:
                done(futures[future], future.result())
    except BaseException:
        _stop(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _context():
    """The local workers' start method: forkserver, so no fork of a parent that may hold threads
    (MindSpore, tqdm's monitor); spawn where there is none."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def _stop(pool) -> None:
    """Ctrl-C or a failed task: stop ``pool``'s workers now rather than after their running tasks."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


def _ignore_interrupt() -> None:
    """A local worker leaves Ctrl-C to the parent, which stops the workers itself (else every
    worker prints its own traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Background:
    """One task of :func:`start_task`: running in a process of its own, or already done."""

    def __init__(self, future, pool=None) -> None:
        self._future = future
        self._pool = pool

    def result(self) -> Any:
        """The task's result, waited for (its exception raised here); its process is then gone."""
        try:
            return self._future.result()
        except BaseException:
            self.close()
            raise
        finally:
            self._shutdown()

    def close(self) -> None:
        """Stop the task if it still runs (the caller failed or was interrupted) and its process."""
        if self._pool is not None:
            _stop(self._pool)
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True, cancel_futures=True)


def start_task(fn: Callable[[Any], Any], task: Any, *, executor: str = "local",
               workers: int | None = None) -> Background:
    """``fn(task)`` started on a local process of its own while the caller goes on (the result
    read later: :meth:`Background.result`); run here and now, before this returns, on one core
    (``workers=1``, or a machine with one) and on Dask or Ray, whose clusters :func:`run_tasks`
    has just left.

    Example:
        >>> start_task(abs, -2, workers=1).result()
        2
    """
    from concurrent.futures import Future, ProcessPoolExecutor

    if executor != "local" or max(1, workers or default_workers()) == 1:
        done: Future = Future()
        done.set_result(fn(task))
        return Background(done)
    pool = ProcessPoolExecutor(max_workers=1, mp_context=_context(), initializer=_ignore_interrupt)
    try:
        return Background(pool.submit(fn, task), pool)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise


def _init_worker(counter) -> None:
    """A local worker: count :func:`report_progress` in the shared ``counter``; Ctrl-C is the
    parent's (:func:`_ignore_interrupt`)."""
    global _progress_sink
    _ignore_interrupt()

    def add(units: int) -> None:
        with counter.get_lock():
            counter.value += units

    _progress_sink = add


def _run_dask(fn, tasks: list, address: str | None, workers: int, processes: bool,
              done: Callable[[int, Any], None]) -> None:
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise InputError("the Dask executor needs the 'distributed' package "
                         "(pip install 'ms-memopt[dask]')", key="--executor") from None
    cluster = None
    try:
        if address is None:
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=processes,
                                   dashboard_address=None)
            client = Client(cluster)
        else:
            why = _dask_reachable(address)
            if why is not None:
                raise InputError(f"cannot use the Dask scheduler at {address}: {why}", key="--address")
            client = Client(address, timeout=30)
    except (OSError, ValueError, TypeError, MemoryError) as exc:
        # a peer that is not a Dask scheduler can make the client read garbage as a frame length
        # (numpy's "Unable to allocate 3.07 EiB"): whatever Client raises is the address's fault
        if cluster is not None:
            cluster.close()
        if isinstance(exc, InputError):
            raise
        raise InputError(f"cannot reach the Dask scheduler at {address}: {type(exc).__name__}: {str(exc)[:200]}",
                         key="--address") from None
    try:
        # pure=False: equal arguments are still separate tasks (no result sharing by hash)
        futures = client.map(fn, tasks, pure=False)
        index_of = {future.key: index for index, future in enumerate(futures)}
        for future in as_completed(futures):
            done(index_of[future.key], future.result())
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


#: largest first message a Dask scheduler's handshake could be (its frame header announces the size)
_DASK_HANDSHAKE_MAX = 64 << 20


def _dask_reachable(address: str, timeout: float = 5.0) -> str | None:
    """Why ``address`` is not a reachable Dask scheduler, or ``None`` (a ``tcp://`` one looks like one).

    An address without a port, a port that refuses, and a peer that does not speak Dask's wire
    protocol are found here in seconds: on connecting, a scheduler sends its handshake at once,
    a message whose first 8 bytes are its little-endian length (``distributed.comm.tcp``); a web
    server sends nothing, or text whose first 8 bytes read as exabytes.
    """
    import socket
    import struct

    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    host, colon, port_text = rest.rpartition(":")
    if not colon or not port_text.isdigit() or not host:
        return "expected SCHEME://HOST:PORT with a port (a scheduler listens on 8786 by default: tcp://HOST:8786)"
    port = int(port_text)
    if not 0 < port < 65536:
        return f"port {port} is not a TCP port (1 to 65535)"
    host = host.strip("[]")
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            if scheme != "tcp":     # tls:// and others: the handshake is encrypted; reaching it is all we check
                return None
            sock.settimeout(timeout)
            head = b""
            while len(head) < 8:
                part = sock.recv(8 - len(head))
                if not part:
                    return "it closed the connection without a Dask handshake (not a Dask scheduler?)"
                head += part
    except socket.timeout:
        return f"no Dask handshake within {timeout:g} s (not a Dask scheduler?)"
    except OSError as exc:
        return exc.strerror or str(exc)
    size = struct.unpack("<Q", head)[0]
    if not 0 < size <= _DASK_HANDSHAKE_MAX:
        return f"it answered {head!r}, not a Dask handshake (not a Dask scheduler?)"
    return None


def _call(fn: Callable[[Any], Any], task: Any) -> Any:
    """``fn(task)``: the one function Ray registers, so ``fn`` may be any picklable callable
    (``ray.remote`` refuses builtins such as ``abs`` and turns a class such as ``int`` into an actor)."""
    return fn(task)


def _ray_reachable(address: str, timeout: float = 10.0) -> str | None:
    """Why a ``host:port`` or ``ray://host:port`` address cannot be reached, or ``None``.

    Ray retries an unreachable GCS address for minutes (822 s for ``127.0.0.1:1`` with Ray
    2.60), logging a line every few seconds; one TCP connection attempt answers in ``timeout``
    seconds at most. Other forms (``auto``, ``local``) are left to ``ray.init``.
    """
    import socket

    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _ray_auth_hint(exc: Exception) -> str:
    """A hint when joining a cluster failed and this process does not send Ray's token.

    Ray 2.60 clusters check a token by default (``~/.ray/auth_token`` on the head), but a
    driver that joins one sends it only with ``RAY_AUTH_MODE=token``; without it Ray retries
    for ~20 s and reports a failed connection, not a refused token.
    """
    if not isinstance(exc, ConnectionError) or os.environ.get("RAY_AUTH_MODE"):
        return ""
    return ("; if the cluster checks Ray's token, set RAY_AUTH_MODE=token and give the head's "
            "token in RAY_AUTH_TOKEN or ~/.ray/auth_token")


def _run_ray(fn, tasks: list, address: str | None, workers: int, done: Callable[[int, Any], None]) -> None:
    try:
        import ray
    except ImportError:
        raise InputError("the Ray executor needs the 'ray' package (pip install 'ms-memopt[ray]')",
                         key="--executor") from None
    joined_here = not ray.is_initialized()   # else: the caller's own ray.init
    if joined_here:
        if address is not None:
            why = _ray_reachable(address)
            if why is not None:
                raise InputError(f"cannot reach the Ray cluster at {address}: {why}", key="--address")
        try:
            if address is None:
                # "local": a new instance of our own; ray.init() without it joins whatever
                # cluster RAY_ADDRESS or /tmp/ray/ray_current_cluster names (even a dead one)
                ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except (ConnectionError, ValueError) as exc:
            # ConnectionError: no cluster there (``auto``), or one that refused us; ValueError:
            # a ray:// address without Ray Client's package (ray[client]), or one Ray cannot parse
            raise InputError(f"cannot use the Ray cluster at {address}: {exc}{_ray_auth_hint(exc)}",
                             key="--address") from None
    remote = ray.remote(_call)
    refs = [remote.remote(fn, task) for task in tasks]
    index_of = {ref: index for index, ref in enumerate(refs)}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    # the task's own exception, as the local executor raises it (Ray's error,
                    # with the worker's traceback, is its __cause__)
                    if isinstance(exc.cause, Exception):
                        raise exc.cause from exc
                    raise
                done(index_of[ref], value)
    finally:
        if joined_here:
            ray.shutdown()
        else:
            # a cluster we joined but did not start goes on: leave it no orphan tasks
            for ref in pending:
                ray.cancel(ref)
