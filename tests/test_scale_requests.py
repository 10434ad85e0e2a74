"""cluster/scale_requests.py and `relayrl scale`: a request goes into the run folder once, the driver takes it
once, and the command prints what the driver did; bad sizes and folders where no job runs are refused, naming
the value and the fix, before anything is written."""

import json
import threading
import time

import pytest

from cli.main import main
from cluster.scale_requests import STALE_S, DriverHeartbeat, ScaleInbox, check_running, request_scale, wait_done


def _run_folder(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    return tmp_path


@pytest.fixture
def running(tmp_path):
    """A run folder whose driver beats (the real heartbeat thread, as Trainer.run starts it)."""
    with DriverHeartbeat(_run_folder(tmp_path)):
        yield tmp_path


def test_a_request_is_taken_once_and_a_newer_one_replaces_an_unread_one(running):
    run = running
    inbox = ScaleInbox(run)
    assert inbox.take() is None
    assert request_scale(run, 3) == 1
    assert request_scale(run, 2) == 2  # not read yet: the newest wins
    assert inbox.take()["rollout"] == 2 and inbox.take() is None
    inbox.done({"id": 2, "rollout": 2}, rollout=2, seconds=1.5)
    assert wait_done(run, 2, timeout_s=0)["seconds"] == 1.5
    # a resumed job (a new inbox on the same folder) does not apply request 2 again; request 3 is new
    assert ScaleInbox(run).take() is None and request_scale(run, 4) == 3 and ScaleInbox(run).take()["rollout"] == 4


def test_a_folder_without_a_config_or_a_size_that_is_not_a_whole_number_of_at_least_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a run folder"):
        request_scale(tmp_path, 2)
    with DriverHeartbeat(_run_folder(tmp_path)):
        with pytest.raises(ValueError, match="--rollout-workers=0: a running job keeps at least one rollout worker"):
            request_scale(tmp_path, 0)
        with pytest.raises(ValueError, match=r"--rollout-workers=2.5: a size is a whole number of workers, got float; "
                                             r"give an integer >= 1"):
            request_scale(tmp_path, 2.5)
    assert not (tmp_path / "control" / "scale_request.json").exists()  # nothing written for the driver


def test_a_folder_where_no_job_runs_is_refused_saying_why(tmp_path):
    run = _run_folder(tmp_path)
    with pytest.raises(ValueError, match=r"no job is running in .*: its driver writes driver.json .* Start or resume"):
        request_scale(run, 2)
    beat = DriverHeartbeat(run).start()
    assert check_running(run)["pid"] > 0
    # a driver killed without stopping its heartbeat: the file stays, and ages past STALE_S (60 s)
    with pytest.raises(ValueError, match=r"is not running: its driver \(pid \d+ on .*\) last wrote its heartbeat "
                                         r"61 s ago .* Resume it with `relayrl train --resume"):
        check_running(run, now=check_running(run)["beat_at"] + STALE_S + 1)
    beat.stop()  # the loop ended: the heartbeat is gone
    (run / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has finished \(summary.json written\): there is no job to resize"):
        request_scale(run, 2)
    assert not (run / "control" / "scale_request.json").exists()


def test_the_heartbeat_is_rewritten_while_the_driver_runs(tmp_path):
    run = _run_folder(tmp_path)
    with DriverHeartbeat(run, interval_s=0.01):
        first = check_running(run)["beat_at"]
        while check_running(run)["beat_at"] == first:  # the thread's next beat (10 ms)
            time.sleep(0.005)
    assert not (run / "control" / "driver.json").exists()


def test_scale_command_writes_the_request_and_reports_the_drivers_record(running, capsys):
    run = running
    assert main(["scale", str(run), "--rollout-workers", "3", "--wait", "0"]) == 0
    assert json.loads(capsys.readouterr().out) == {"id": 1, "rollout": 3, "status": "requested"}
    # nobody applies it: exit 1 naming the wait
    assert main(["scale", str(run), "--rollout-workers", "3", "--wait", "0.3"]) == 1
    assert "not applied within --wait 0.3 s" in capsys.readouterr().err
    # a driver that refuses the next request (3): the command prints its record and exits 1
    def refuse_next():
        inbox = ScaleInbox(run)
        while (request := inbox.take()) is None or request["id"] < 3:
            time.sleep(0.01)
        inbox.done(request, rollout=1, error="no resources")

    driver = threading.Thread(target=refuse_next)
    driver.start()
    assert main(["scale", str(run), "--rollout-workers", "3", "--wait", "10"]) == 1
    driver.join()
    assert json.loads(capsys.readouterr().out) == {**json.loads((run / "control" / "scale_done.json").read_text())}
    assert json.loads((run / "control" / "scale_done.json").read_text())["error"] == "no resources"
    assert main(["scale", str(run / "nowhere"), "--rollout-workers", "2"]) == 2


def test_scale_command_refuses_bad_sizes_and_a_stopped_job_with_exit_2(tmp_path, capsys):
    run = _run_folder(tmp_path)
    with DriverHeartbeat(run):
        with pytest.raises(SystemExit) as exit_:  # argparse: not an integer
            main(["scale", str(run), "--rollout-workers", "2.5"])
        assert exit_.value.code == 2
        assert "'2.5' is not a whole number of workers: give an integer >= 1" in capsys.readouterr().err
        assert main(["scale", str(run), "--rollout-workers", "0"]) == 2
        assert "--rollout-workers=0: a running job keeps at least one rollout worker" in capsys.readouterr().err
    # the driver's loop ended
    assert main(["scale", str(run), "--rollout-workers", "2", "--wait", "0"]) == 2
    assert "no job is running in" in capsys.readouterr().err


def test_scale_wait_ends_as_soon_as_the_driver_stops_beating(tmp_path, capsys):
    run = _run_folder(tmp_path)
    beat = DriverHeartbeat(run, interval_s=3600).start()  # written once, then never again: a killed driver

    def driver_dies():
        time.sleep(0.3)
        beat_file = run / "control" / "driver.json"
        stale = {**json.loads(beat_file.read_text()), "beat_at": time.time() - STALE_S - 1}
        beat_file.write_text(json.dumps(stale))

    killer = threading.Thread(target=driver_dies)
    killer.start()
    started = time.monotonic()
    assert main(["scale", str(run), "--rollout-workers", "3", "--wait", "600"]) == 1
    killer.join()
    # the command noticed at its next poll, not at the end of --wait
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert "request 1 not applied: the job in" in err and "last wrote its heartbeat" in err
    # and the same from Python
    with pytest.raises(ValueError, match="is not running"):
        wait_done(run, 1, timeout_s=600)
    beat.stop()
