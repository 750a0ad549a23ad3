"""``lightning_par3d.utils.fresh_interpreter.call``: each call in a process of its own that shares nothing of the
caller's torch state, forked from one clean server per calling process; errors, exits and timeouts come back as
errors."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from lightning_par3d.utils import fresh_interpreter
from lightning_par3d.utils.fresh_interpreter import call

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server forks: Linux only")


def where_am_i(tag: str) -> dict:
    import torch.distributed as dist

    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "cwd": os.getcwd(),
        "tag": os.environ.get("PAR3D_TEST_TAG"),
        "rank": os.environ.get("RANK"),
        "group": dist.is_initialized(),
        "arg": tag,
    }


class Refused(ValueError):
    pass


def refuse() -> None:
    raise Refused("no, and here is why")


def exit_without_result() -> None:
    print("last words", file=sys.stderr, flush=True)
    os._exit(3)


def sleep_forever() -> None:
    time.sleep(10**6)


@LINUX
def test_each_call_is_a_new_child_of_one_server_with_the_callers_environment_and_directory(
    new_interpreter, tmp_path, monkeypatch
):
    here = os.getcwd()
    monkeypatch.setenv("PAR3D_TEST_TAG", "first")
    monkeypatch.setenv("RANK", "3")  # a rank's variables stay out: the child is no rank of the caller's job
    first = call(where_am_i, "a")
    monkeypatch.setenv("PAR3D_TEST_TAG", "second")
    monkeypatch.chdir(tmp_path)
    second = call(where_am_i, tag="b")
    assert first["pid"] != second["pid"] and os.getpid() not in (first["pid"], second["pid"])
    assert first["parent"] == second["parent"] != os.getpid()  # both forks of the same server
    assert (first["tag"], second["tag"]) == ("first", "second")
    assert (first["cwd"], second["cwd"]) == (here, str(tmp_path))
    assert first["rank"] is None and not first["group"] and (first["arg"], second["arg"]) == ("a", "b")


def test_what_the_function_raises_is_raised_here_with_the_childs_traceback(new_interpreter):
    with pytest.raises(Refused, match="here is why") as info:
        call(refuse, what="the refusal")
    assert "fresh interpreter of the refusal" in info.value.__notes__[0]


def test_a_child_that_exits_without_a_result_is_an_error_with_its_code_and_last_words(new_interpreter):
    with pytest.raises(RuntimeError, match=r"the exit: its interpreter exited with code 3 and no result:\nlast words"):
        call(exit_without_result, what="the exit")


@LINUX
def test_a_timeout_kills_the_child_and_the_server_serves_the_next_call(new_interpreter):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the sleep did not finish within 1 s"):
        call(sleep_forever, what="the sleep", timeout_s=1)
    assert time.monotonic() - started < 30
    assert call(where_am_i, "after")["arg"] == "after"


@LINUX
def test_a_timeout_before_the_server_answers_leaves_no_answer_for_the_next_call(new_interpreter):
    """A call that times out while a just-started server is still importing: the next call gets its own result, not
    the answers the server owed the first."""
    fresh_interpreter.stop_server()
    with pytest.raises(RuntimeError, match=r"the early call did not finish within 0\.5 s"):
        call(where_am_i, "early", what="the early call", timeout_s=0.5)
    assert call(where_am_i, "next")["arg"] == "next"


@LINUX
def test_a_server_that_died_is_started_again_and_stop_server_ends_it(new_interpreter):
    before = call(where_am_i, "before")["parent"]
    os.kill(before, 9)  # whether the next call finds it dead or it dies under that call, a new server serves it
    after = call(where_am_i, "after")["parent"]
    assert after != before
    fresh_interpreter.stop_server()
    assert not Path(f"/proc/{after}").exists()


def test_without_fork_each_call_is_a_new_interpreter_of_its_own(new_interpreter, monkeypatch, tmp_path):
    """macOS and Windows: no server, a new ``python`` per call, with the same environment, directory and errors."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("PAR3D_TEST_TAG", "plain")
    monkeypatch.chdir(tmp_path)
    got = call(where_am_i, "x")
    assert got["parent"] == os.getpid() and (got["tag"], got["cwd"], got["arg"]) == ("plain", str(tmp_path), "x")
    with pytest.raises(RuntimeError, match=r"its interpreter exited with code 3 and no result:\nlast words"):
        call(exit_without_result, what="the exit")


def environment_value(name: str) -> str | None:
    return os.environ.get(name)


@LINUX
def test_the_request_file_holds_no_environment_is_private_and_is_removed(monkeypatch, new_interpreter):
    """The child has the caller's environment, but the request file written for it carries only what changed since
    its server started: a variable the server started with (``PATH`` here; a token in a real job) never reaches the
    disk, one set since does. The file is 0600 and gone once read."""
    written: list[tuple[Path, int, bytes]] = []
    original = fresh_interpreter._write_request

    def recorded(request: Path, *args: object) -> None:
        original(request, *args)  # type: ignore[arg-type]
        written.append((request, request.stat().st_mode & 0o777, request.read_bytes()))

    monkeypatch.setattr(fresh_interpreter, "_write_request", recorded)
    assert call(environment_value, "PATH") == os.environ["PATH"]  # the child has it, from its server
    monkeypatch.setenv("PAR3D_TEST_TAG", "changed after the server started")
    assert call(environment_value, "PAR3D_TEST_TAG") == "changed after the server started"  # carried as a change
    (first, mode, data), (_, _, second) = written
    assert mode == 0o600 and os.environ["PATH"].encode() not in data + second
    assert b"changed after the server started" in second
    assert not first.exists()
