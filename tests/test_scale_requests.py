"""cluster/scale_requests.py and `relayrl scale`: a request goes into the run folder once, the driver takes it
once, and the command prints what the driver did."""

import json
import threading
import time

import pytest

from cli.main import main
from cluster.scale_requests import ScaleInbox, request_scale, wait_done


def _run_folder(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    return tmp_path


def test_a_request_is_taken_once_and_a_newer_one_replaces_an_unread_one(tmp_path):
    run = _run_folder(tmp_path)
    inbox = ScaleInbox(run)
    assert inbox.take() is None
    assert request_scale(run, 3) == 1
    assert request_scale(run, 2) == 2  # not read yet: the newest wins
    assert inbox.take()["rollout"] == 2 and inbox.take() is None
    inbox.done({"id": 2, "rollout": 2}, rollout=2, seconds=1.5)
    assert wait_done(run, 2, timeout_s=0)["seconds"] == 1.5
    # a resumed job (a new inbox on the same folder) does not apply request 2 again; request 3 is new
    assert ScaleInbox(run).take() is None and request_scale(run, 4) == 3 and ScaleInbox(run).take()["rollout"] == 4


def test_a_folder_without_a_config_or_a_size_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a run folder"):
        request_scale(tmp_path, 2)
    with pytest.raises(ValueError, match="--rollout-workers=0: a running job keeps at least one"):
        request_scale(_run_folder(tmp_path), 0)


def test_scale_command_writes_the_request_and_reports_the_drivers_record(tmp_path, capsys):
    run = _run_folder(tmp_path)
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
    assert main(["scale", str(tmp_path / "nowhere"), "--rollout-workers", "2"]) == 2
