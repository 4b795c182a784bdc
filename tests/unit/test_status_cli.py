"""``python -m mpi4jax_dist status`` where no job answers as one should: none runs,
a killed rank's socket is left, several jobs run, a reply is cut short or not
one (the running jobs' cases: tests/jobs/test_status.py)."""

from __future__ import annotations

import socket
import threading

import pytest

from mpi4jax_dist.diagnostics import cli, status

HOST = socket.gethostname()


def here(folder):
    """The folder of this host's sockets in ``folder``, made as a rank makes it."""
    (folder / HOST).mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder / HOST


def run(capsys, monkeypatch, folder, *args) -> tuple[int, str, str]:
    monkeypatch.setenv("MPI4JAX_DIST_STATUS_DIR", str(folder))
    code = cli.main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def listener(path, reply: bytes | None = None) -> socket.socket:
    """A socket listening at ``path``; with ``reply``, a thread answers one
    client with it."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    if reply is not None:

        def answer():
            for _ in range(2):  # find_jobs's probe, then the request
                client, _ = server.accept()
                with client:
                    client.settimeout(5)
                    try:
                        if client.recv(64):
                            client.sendall(reply)
                    except OSError:
                        pass

        threading.Thread(target=answer, daemon=True).start()
    return server


def test_no_job_is_one_line_naming_the_folder_and_the_variable(
    tmp_path, capsys, monkeypatch
):
    code, out, err = run(capsys, monkeypatch, tmp_path / "none")
    assert code == 1 and out == ""
    assert err.count("\n") == 1, err
    assert "no job of this user's answers on this node" in err
    assert str(tmp_path / "none" / HOST) in err and "MPI4JAX_DIST_STATUS_DIR" in err


def test_another_host_s_sockets_are_neither_asked_nor_removed(
    tmp_path, capsys, monkeypatch
):
    """On a shared file system another node's sockets refuse a connection from
    here, as a dead rank's would: they are left alone."""
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    theirs = tmp_path / "elsewhere" / "jother.0.sock"
    listener(theirs).close()
    code, _, err = run(capsys, monkeypatch, tmp_path)
    assert code == 1 and "no job" in err, err
    assert theirs.exists()


def test_a_killed_rank_s_socket_is_removed_not_asked(tmp_path, capsys, monkeypatch):
    left = here(tmp_path) / "jdead.0.sock"
    listener(left).close()  # bound, then no process listens: as after SIGKILL
    assert left.exists()
    code, _, err = run(capsys, monkeypatch, tmp_path)
    assert code == 1 and "no job" in err, err
    assert not left.exists()


def test_two_jobs_here_are_listed_to_choose_from(tmp_path, capsys, monkeypatch):
    servers = [
        listener(here(tmp_path) / f"j{key}.{r}.sock") for key in "ab" for r in (0, 1)
    ]
    try:
        code, _, err = run(capsys, monkeypatch, tmp_path)
        assert code == 1, err
        assert "2 jobs run on this node: name one: --job ja (ranks 0-1 here); " in err
        assert "--job jb (ranks 0-1 here)" in err
        code, _, err = run(capsys, monkeypatch, tmp_path, "--job", "jc")
        assert code == 1, err
        assert (
            "--job jc: no such job answers on this node (the jobs here: ja, jb)" in err
        )
    finally:
        for server in servers:
            server.close()


@pytest.mark.parametrize(
    "reply, expected",
    [
        (b"HTTP/1.1 200 OK\n", "the rank's reply is not 'mpi4jax_dist status 1'"),
        (b"mpi4jax_dist status 1\tjob\t4\t0\n0\tvm\t1\t5", "cut short (no end line)"),
        (
            b"mpi4jax_dist status 1\tjob\tfour\t0\nend\t1\t5\t2\n",
            "the rank's reply has no numbers where they belong",
        ),
    ],
)
def test_a_reply_that_is_not_one_is_one_line(
    tmp_path, capsys, monkeypatch, reply, expected
):
    server = listener(here(tmp_path) / "jx.0.sock", reply)
    try:
        code, out, err = run(capsys, monkeypatch, tmp_path)
    finally:
        server.close()
    assert code == 1 and out == "", out
    assert expected in err and err.count("\n") == 1, err


def test_a_whole_reply_of_a_job_that_moves_names_no_rank_by_its_count():
    """Rank 0 entered 7 more calls while the others were asked: the counts, read
    apart, name no rank; the shares of time blocked name rank 2."""
    reply = (
        "mpi4jax_dist status 1\t10.0.0.1:1234\t3\t0\n"
        "0\tn1\t11\t20\t900000000\t1000000000\t1\tallreduce #20\tjob.py:9 in f\n"
        "1\tn1\t12\t25\t950000000\t1000000000\t1\tallreduce #25\tjob.py:9 in f\n"
        "2\tn2\t13\t24\t10000000\t1000000000\t1\t\tjob.py:7 in f\n"
        "end\t3\t5000000\t27\n"
    )
    # A line whose numbers are not numbers is no rank's: left out, not raised.
    result = status.parse(reply.replace("end\t", "9\tn3\tpid\t1\t1\t1\t1\t\t\nend\t"))
    assert sorted(result.ranks) == [0, 1, 2] and result.missing == []
    assert result.moved == 7
    assert status.lagging(result) == ([], [2])
    text = status.text(result)
    assert "the job moves, and counts read apart do not compare" in text
    assert "waited for: rank 2 (blocked in collectives 1.0 %" in text


def test_a_rank_that_does_not_answer_is_one_line(tmp_path, capsys, monkeypatch):
    """A socket whose process accepts but never answers (a stopped rank's
    backlog): the wait is bounded, and said."""
    monkeypatch.setattr(status, "ASK_TIMEOUT_S", 0.5)
    server = listener(here(tmp_path) / "jz.3.sock")
    try:
        code, _, err = run(capsys, monkeypatch, tmp_path)
    finally:
        server.close()
    assert code == 1, err
    assert "rank 3 did not answer within 0.5 s" in err and err.count("\n") == 1
