"""The local Ray of ``modalign run``: listening on loopback only, and cleaned up after a killed run.

Where it sits: a run without ``runtime.address`` starts its own single-node Ray here, inside the
private folder of ``schemas.environment.ray_temp_dir``, after ``reap_orphans`` has ended what a
killed earlier run left there. What follows was measured on Ray 2.60.0 (Linux), over the
processes of one session running one actor (``ss -ltnpu``, psutil);
``tests/integration/test_local_ray.py`` checks it on every run.

Binding. Ray 2.60's gRPC servers (GCS, the raylet's node and object managers, every core
worker) listen on loopback if the node IP is a loopback address and on the wildcard otherwise
(the table in Ray PR #65867; PR #59852, which meant to bind the node IP instead, does not hold
in 2.60). By default the node IP is the host's routable one, and the session listens on:

    gcs_server              *:port (:: dual-stack)     GCS
    raylet                  *:port, *:port             node manager, object manager
    driver, each worker     *:port                     core worker
    ray::RuntimeEnvAgent    <host IP>:port             runtime-env HTTP
    with ray[default] also  0.0.0.0:44217 (autoscaler metrics), 0.0.0.0:44227 (dashboard
                            metrics), 0.0.0.0:port (agent metrics), *:port (agent gRPC),
                            <host IP>:52365 and 127.0.0.1:52365 (agent HTTP)

``ray.init(_node_ip_address="127.0.0.1")`` alone changes none of it: ``ray.init`` swaps a
loopback address for the host's routable IP (``services.resolve_ip_for_localhost``) unless Ray
clusters are disabled, the switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets once, when Ray is
imported, as ``ray_constants.ENABLE_RAY_CLUSTER``. ``start_local_ray`` turns that flag off for
the one ``ray.init`` call, so the node IP is 127.0.0.1 and every listener above binds 127.0.0.1
(with ray[default] installed too): no Ray process of ours listens on any other address, TCP or
UDP, so nothing is left open to the network. The node IP is checked after start: a Ray that
resolves it otherwise is shut down and the run refused.

Folder. Ray chmods its temp folder and the session folders in it 0777 (``try_to_create_directory``
in ``ray._common.utils``, meant for a shared ``/tmp/ray``), and not only in the driver: every
worker does it again when it starts. Handed the private folder itself, Ray would open it to every
user for the whole run; so Ray gets ``ray_folder(temp_dir)``, a folder inside it, and the 0700
folder around it, which Ray never touches, keeps other users out of all of it.

Loopback is no wall between the users of one machine: any of them can connect to those ports.
Ray 2.60 turns token authentication on for a local ``ray.init`` (the token is
``~/.ray/auth_token``, written with the umask's mode, unless ``RAY_AUTH_TOKEN(_PATH)`` is set):
the runtime-env agent answers 401 without it and 403 to a wrong one, and a client with a wrong
token did not get through to the GCS in 60 s. The Prometheus ports of ray[default] (44217, 44227, the
agent's) are outside it: they serve the cluster's metrics to any local user.

Orphans. A SIGTERM to the driver is clean: Ray's handler exits through ``ray.shutdown`` and
nothing is left. A SIGKILL (or the OOM killer, or a crash) is not. Ray shares the driver's fate through the
kernel: gcs_server, raylet, the monitor and the dashboard (there is no log monitor:
``_without_log_monitor``) are started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` and die at
once (the signal comes when the *thread* that called ``ray.init`` ends: call it from the main
thread). The raylet's children have no such
signal: workers (``ray::IDLE``, ``ray::<Actor>``) see the raylet gone and exit within about
5 s, but ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` notice it and then block for 60 s
telling the dead GCS (``publish_error`` with a fixed 60 s timeout, in
``ray._private.utils.publish_error_to_driver``), ignoring SIGTERM meanwhile; they exit 60-90 s
after the driver, keeping their ports and memory until then. No ``ray.init`` option changes
that, so each start first calls ``reap_orphans``: it ends every Ray process of this user in a
session under the temp folder whose driver is dead, with SIGTERM and, 3 s later, SIGKILL (the
one that ends the agents). Ray names a session ``session_<start time>_<driver pid>``; the driver
is dead when that pid is gone, or belongs to a process started after the session folder was made
(a reused pid). A session whose driver lives, another run sharing the folder, is never touched.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modalign.schemas.environment import ray_temp_dir
from modalign.schemas.errors import EnvironmentFaultError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RAY_FOLDER = "ray"
TERMINATE_GRACE_S = 3.0
# The raylet connects to its own object store, started on another thread, as a client with these
# retries: when it asks before the store listens (about 4 starts in 10 here), the default waits a
# whole 1 s before the next try (Ray's start: 2.4 s or 3.4 s). Tries 100 ms apart, 100 of them: the
# same 10 s of patience as the default's 10 x 1 s, for the workers' connections too.
FAST_CONNECT = {"raylet_client_connect_timeout_milliseconds": 100, "raylet_client_num_connect_attempts": 100}
# Ray's session folder: session_<%Y-%m-%d_%H-%M-%S_%f>_<pid of the driver that started it>.
_SESSION = re.compile(r"session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d{6}_(\d+)")
# A process started from an installed Ray package (gcs_server, raylet, monitor, dashboard...).
_RAY_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\]ray[/\\]")
# A driver's process is created before the session folder it makes; allow for clock-tick rounding.
_CREATE_TIME_SLACK_S = 2.0


def start_local_ray(num_cpus: int, temp_dir: Path) -> None:
    """Start a single-node Ray of ``num_cpus`` CPUs in ``ray_folder(temp_dir)``, listening on
    127.0.0.1 only, after reaping what killed runs left in ``temp_dir`` (made private, 0700).

    Raises ``EnvironmentFaultError`` (Ray shut down again) if the node did not get a loopback
    IP, which means this Ray no longer honours the switch described in the module docstring."""
    import ray

    temp_dir = ray_temp_dir(temp_dir)
    reaped = reap_orphans(temp_dir)
    if reaped:
        log.warning("ended %d Ray process(es) left by killed runs in %s", reaped, temp_dir)
    atexit.unregister(stop_local_ray)
    atexit.register(stop_local_ray)  # after Ray's own handler (registered on its import), so it runs first
    with _ray_clusters_disabled(), _without_log_monitor():
        context = ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
                           _temp_dir=str(ray_folder(temp_dir)), _node_ip_address=LOOPBACK,
                           _system_config=FAST_CONNECT)
    node_ip = context.address_info["node_ip_address"]
    if not ipaddress.ip_address(node_ip).is_loopback:
        stop_monitor()
        ray.shutdown()
        raise EnvironmentFaultError(
            f"local Ray {ray.__version__} took the node IP {node_ip}, not loopback, so it would listen on "
            "the network; install the Ray version modalign pins, or start a cluster yourself and set "
            "runtime.address")


def stop_local_ray() -> None:
    """Shut down the local Ray this process started: ``stop_monitor``, then ``ray.shutdown``.

    Registered at exit by ``start_local_ray``, so it runs before Ray's own exit handler, which
    would first sleep 0.5 s for worker log lines to reach the driver's terminal (we forward
    none: ``log_to_driver=False``) and then wait on the monitor. With both, a run's exit took
    ~1.5 s; now ~0.35 s. Ray's handler then finds nothing to do. A no-op when this process
    did not start the Ray it is connected to, or after ``ray.shutdown``."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.head:
        return
    stop_monitor()
    ray.shutdown()


def stop_monitor() -> None:
    """End the local Ray's autoscaler monitor (SIGKILL) before ``ray.shutdown`` ends the rest.

    ``ray.shutdown`` ends the raylet, then the GCS, then the monitor, each with SIGTERM and up
    to 1 s to exit. The monitor's SIGTERM handler reports its own death to the GCS, which is
    gone by then, so it never exits in time: every shutdown waited the whole second, then
    SIGKILLed it. A fixed-size local cluster has nothing for an autoscaler to do and the
    monitor keeps no state, so it is killed first. A no-op when this process did not start the
    Ray it is connected to, or after ``ray.shutdown``."""
    import ray
    from ray._private import ray_constants

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.head:
        return
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            try:
                info.process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("Ray's autoscaler monitor (pid %d) did not exit when killed", info.process.pid)


def join_ray(address: str) -> None:
    """Join the running Ray cluster at ``address`` (``auto``, ``HOST:PORT``).

    A cluster whose nodes were started on loopback (``ray start --node-ip-address 127.0.0.1``:
    one machine, nothing on the network) listens only there, but ``ray.init`` would swap
    ``127.0.0.1`` for the host's routable IP and wait for a GCS that is not there; so for a
    loopback address this driver keeps it, and joins as a loopback node too."""
    import ray

    host = address.rpartition(":")[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        ray.init(address=address, log_to_driver=False)
        return
    with _ray_clusters_disabled():
        ray.init(address=address, log_to_driver=False, _node_ip_address=LOOPBACK)


@contextmanager
def _without_log_monitor() -> Iterator[None]:
    """A local Ray started inside this block has no log monitor (``ray start
    --include-log-monitor=False``; ``ray.init`` has no such option). That process tails every
    worker's log files and publishes their new lines for drivers to print; ours asks for none
    (``log_to_driver=False``), and the files stay where they are. It cost ~0.6 CPU s of a 60 s sample meeting's run and
    2-4 CPU s of a 600 s video's, on the cores the pipeline runs on."""
    from ray._private.node import Node

    saved = getattr(Node, "start_log_monitor", None)
    if saved is None:  # another Ray: it starts what it starts
        yield
        return
    Node.start_log_monitor = lambda self: None
    try:
        yield
    finally:
        Node.start_log_monitor = saved


@contextmanager
def _ray_clusters_disabled() -> Iterator[None]:
    """What ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` does, for a Ray that is already imported:
    ``ray.init`` then keeps a loopback node IP instead of swapping in the host's routable one."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def ray_folder(temp_dir: Path) -> Path:
    """Ray's own temp folder (its ``session_*`` folders and ``session_latest``) inside ``temp_dir``."""
    return Path(temp_dir) / RAY_FOLDER


def reap_orphans(temp_dir: Path) -> int:
    """End the Ray processes of this user left by sessions under ``temp_dir`` whose driver is
    dead: SIGTERM, then SIGKILL after ``TERMINATE_GRACE_S``. Returns how many ended.

    Sessions of a live driver (another run sharing the folder) and processes of other users
    are never touched."""
    psutil = _psutil()
    dead = [s for s in _sessions(temp_dir) if not _driver_alive(psutil, *_session_driver(s))]
    if not dead:
        return 0
    prefixes = _prefixes(dead)
    targets = [proc for proc in _ray_processes(psutil) if _session_of(psutil, proc, prefixes)]
    signalled = []
    for proc in targets:
        try:
            proc.terminate()
            signalled.append(proc)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(signalled, timeout=TERMINATE_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=TERMINATE_GRACE_S)
    stuck = [p for p in alive if not _ended(psutil, p)]
    for proc in stuck:
        log.warning("Ray process %d of a dead session in %s survived SIGKILL", proc.pid, temp_dir)
    return len(signalled) - len(stuck)


def session_processes(temp_dir: Path) -> dict[Path, list[Any]]:
    """This user's running Ray processes (``psutil.Process``) in the sessions under ``temp_dir``,
    by session folder (named ``session_<start time>_<driver pid>``); sessions without any are left out."""
    psutil = _psutil()
    prefixes = _prefixes(list(_sessions(temp_dir)))
    found: dict[Path, list[Any]] = {}
    for proc in _ray_processes(psutil) if prefixes else ():
        if (session := _session_of(psutil, proc, prefixes)) is not None:
            found.setdefault(session, []).append(proc)
    return found


def _psutil() -> Any:
    import ray  # noqa: F401  Ray bundles psutil and puts it on sys.path when imported
    import psutil

    return psutil


def _sessions(temp_dir: Path) -> Iterator[Path]:
    """Ray's session folders in ``temp_dir``: in ``ray_folder``, or (runs before it) at the top."""
    for path in [*ray_folder(temp_dir).glob("session_*"), *Path(temp_dir).glob("session_*")]:
        if not path.is_symlink() and path.is_dir() and _SESSION.fullmatch(path.name):
            yield path


def _session_driver(session: Path) -> tuple[int, float]:
    """The driver's pid, from Ray's folder name, and a time it had started by: the folder's ctime
    (the driver made the folder; a later chmod only moves the ctime later)."""
    m = _SESSION.fullmatch(session.name)
    assert m is not None
    return int(m.group(1)), session.stat().st_ctime


def _driver_alive(psutil: Any, pid: int, started_at: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() <= started_at + _CREATE_TIME_SLACK_S and not _ended(psutil, proc)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # not ours to judge: leave it alone
        return True


def _ended(psutil: Any, proc: Any) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ray_processes(psutil: Any) -> Iterator[Any]:
    """This user's processes that are Ray's: a ``ray::`` title (workers, agents), or a program
    or Python script of an installed Ray package; never this process."""
    me, uid = os.getpid(), os.getuid()
    for proc in psutil.process_iter(["uids", "cmdline"]):
        info = proc.info
        argv = info.get("cmdline") or []
        if proc.pid == me or info.get("uids") is None or info["uids"].real != uid or not argv:
            continue
        script = next((arg for arg in argv[1:] if not arg.startswith("-")), "")  # python -u <script>
        if argv[0].startswith("ray::") or _RAY_PACKAGE.search(argv[0]) or _RAY_PACKAGE.search(script):
            if not _ended(psutil, proc):
                yield proc


def _prefixes(sessions: list[Path]) -> dict[Path, tuple[str, ...]]:
    """Each session's folder as a path prefix, as given and resolved (open files show the latter)."""
    return {s: tuple({f"{path}{os.sep}" for path in (s, s.resolve())}) for s in sessions}


def _session_of(psutil: Any, proc: Any, prefixes: dict[Path, tuple[str, ...]]) -> Path | None:
    """The session whose folder ``proc`` names on its command line or holds a file in (every Ray
    process keeps its log files in ``<session>/logs`` open), if any."""
    argv = proc.info.get("cmdline") or []
    for session, roots in prefixes.items():
        if any(root in arg or f"{arg}{os.sep}" in roots for arg in argv for root in roots):
            return session
    try:
        open_paths = [f.path for f in proc.open_files()]
    except psutil.Error:  # gone or unreadable meanwhile: not provably in a session
        return None
    for session, roots in prefixes.items():
        if any(path.startswith(roots) for path in open_paths):
            return session
    return None
