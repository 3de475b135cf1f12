"""The commands' console: `launch` (Hydra, after a check of the group choices), `run_cli` (a bad
setting is one `error:` line) and `quiet_library_output`, which turns off library chatter that does
not help a loorl user, each item for a stated reason (no blanket filter: a new warning still shows).
Light to import: a command's settings are checked before Lightning and transformers load.
"""

from __future__ import annotations

import logging
import warnings

log = logging.getLogger("loorl")


def launch(config_name: str, main) -> None:
    """`python src/<command>.py [overrides]`: misspelt group choices are one `error:` line before Hydra
    starts; then Hydra composes `conf/<config_name>.yaml` and calls `main(cfg)`. `train`'s `--plan` is
    `plan=true`."""
    import sys

    import hydra

    from loorl.config import CONF_DIR, check_group_choices
    from loorl.errors import ConfigError

    if config_name == "train":  # `--plan`: the memory plan's flag spelling of `plan=true`
        sys.argv = [("plan=true" if a == "--plan" else a) for a in sys.argv]
    try:
        check_group_choices([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigError as err:
        print(f"error: {err}")
        raise SystemExit(2) from None
    try:
        hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(main)()
    except SystemExit as stop:
        if not _ends_the_process():
            raise
        exit_without_teardown(stop.code)
    if _ends_the_process():
        exit_without_teardown(0)


def _ends_the_process() -> bool:
    """Whether the command's end is the process's: the script is the process's main module, run with
    no tracer, profiler or `-i` waiting for it to return. `python -m cProfile -o x.prof src/train.py`,
    a debugger, coverage or memray then write what they gathered at their own end."""
    import os
    import sys

    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    argv0 = sys.argv[0] if sys.argv else ""
    if main_file is None or not argv0 or not os.path.exists(argv0):
        return False
    return (
        not sys.flags.inspect
        and sys.gettrace() is None
        and sys.getprofile() is None
        and os.path.samefile(main_file, argv0)
    )


def exit_without_teardown(code: int | str | None) -> None:
    """End the process as `sys.exit(code)` would, without the interpreter's teardown of its modules.

    The interpreter's own first steps of exiting run as it runs them: the wait for the threads that are
    not daemons (thread pools' workers included), then the exit handlers (`atexit`: logging's flush and
    close, wandb's finish, multiprocessing's join of its children, `weakref.finalize` callbacks). Then
    stdout and stderr are flushed and the process ends (`os._exit`). Skipped: the final garbage
    collection over every object of torch, transformers, Lightning and their imports, 2-3 s at the end
    of every run and of every rank's process (the quick run, 5 paired runs on a 2-core AVX2 EPYC:
    15.0 s median against 16.8 s). Nothing written is lost: the loggers write their files closed, the
    log files are logging's, closed by its exit handler, and C's buffers are flushed as C's exit
    flushes them. A code that is not an int is printed to stderr and exits 1, as Python does. Only
    where the command ends the process (`_ends_the_process`); a profiler or debugger gets the usual
    end."""
    import atexit
    import ctypes
    import os
    import sys
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):  # as Python does: the object printed to stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    # private, but the interpreter's own steps (Py_FinalizeEx's wait_for_thread_shutdown and atexit calls)
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None and threading.current_thread() is threading.main_thread():
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written there
            if stream is sys.stdout and code == 0:
                code = 120  # Python's status where the final flush of stdout fails
    try:  # C's own buffers (a library's printf into a pipe, oneDNN's verbose lines), as C's exit does
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not on Linux or macOS)
        pass
    os._exit(code)


def _to_log_files(err: BaseException) -> None:
    """`err` with its traceback into the log files only (train.log), not the console."""
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, "%s", (err,), (type(err), err, err.__traceback__)
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run_cli(fn, cfg, *, check=None):
    """A command's body as the CLI runs it: quiet libraries; oneDNN's cache capped before the job's
    first product (`loorl.util.onednn`); a bad setting prints one `error:` line and exits 2 (no
    traceback). `check`: the command's own checks, `check(cfg) -> settings`, run first and handed to
    `fn(cfg, settings)`, so that a bad setting is reported before `fn`'s libraries load (train's
    settings check takes about 4 s; Lightning and transformers another 7)."""
    import os

    from loorl.errors import ConfigError, ServersLost
    from loorl.parallel.distributed import is_distributed, lost_peer, rank_and_world
    from loorl.util.onednn import cap_onednn_primitive_cache

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cap_onednn_primitive_cache()
    try:
        if check is None:
            quiet_library_output()
            return fn(cfg)
        settings = check(cfg)
        quiet_library_output()  # (it imports transformers)
        return fn(cfg, settings)
    except ConfigError as err:
        print(f"error: {err}")
        raise SystemExit(2) from None
    except ServersLost as err:
        _to_log_files(err)  # the traceback in the run's log file, one line on the console
        print(f"error: {err}")
        raise SystemExit(1) from None
    except Exception as err:
        lost = lost_peer(err) if is_distributed() else None
        if lost is None:
            raise
        rank, world = rank_and_world()
        log.error("rank %d of %d: lost another process of the run (%s)", rank, world, lost, exc_info=err)
        print(
            f"error: rank {rank} of {world} lost another process of the run ({lost}): a process died, or "
            "stopped answering for trainer.strategy.timeout; its log (train_rank<r>.log in the run folder) "
            "says why. Checkpoints already written are whole: run the same command with resume_from=auto "
            "to continue"
        )
        logging.shutdown()
        # not the interpreter's exit: gloo's threads on a broken process group can hang or abort it
        os._exit(1)


def quiet_library_output() -> None:
    # Lightning's info lines ("GPU available: False", "Seed set to 0", the litlogger advert): info,
    # not warnings; Lightning documents raising these loggers' level to quiet them.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # transformers' per-call "Loading weights" / "Writing model shards" bars (sub-second here)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    # Lightning 2.6.6 (the newest) builds torch's LeafSpec, which torch 2.13 deprecates: a library
    # pairing issue, not something a loorl setting can change. Only this message is filtered.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # Under DDP/FSDP Lightning suggests `sync_dist=True` for every epoch-level metric. loorl's metrics
    # are reduced before they are logged (sums and counts over ranks, `loorl.parallel.distributed`), so they
    # are the same on every rank; Lightning's sync would average them once more per metric.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('(rollout|train|perf)/")
