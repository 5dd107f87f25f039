"""`mlm-pipeline alerts install` on a real Prefect server (`prefect server start`, whose
triggers and actions services run the automations): twice, leaving one automation of each
name; then a failing flow run of a project flow's name reaches a webhook receiver on
loopback, and the payload names the run and its state. `alerts remove` deletes what
`install` made."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.servers import BIN, start_prefect_server, stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ZOMBIE_FILE = ROOT / "flows" / "automations" / "crash-zombie-flows.yaml"
#: The failure automation's name, as the docs give it (not imported from the code).
FAILURE_NAME = "mlm-pipeline-flow-run-failed"
ZOMBIE_NAME = yaml.safe_load(ZOMBIE_FILE.read_text())["automations"][0]["name"]
#: Seconds to wait for the notification after the flow run failed.
NOTIFY_WAIT_S = 90

#: Prints, as JSON, the server's automations of the two names and the webhook block.
LIST_SCRIPT = textwrap.dedent(f"""
    import json
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        out = {{name: [json.loads(a.model_dump_json())
                      for a in client.read_automations_by_name(name=name)]
               for name in ({FAILURE_NAME!r}, {ZOMBIE_NAME!r})}}
        blocks = client.read_block_documents(include_secrets=False)
        out["blocks"] = [{{"id": str(b.id), "name": b.name, "slug": b.block_type.slug,
                          "data": json.loads(json.dumps(b.data, default=str))}}
                         for b in blocks if not b.is_anonymous]
    print(json.dumps(out))
""")

#: A flow named like the project's pretraining flow that fails; prints its flow run id.
FAILING_FLOW = textwrap.dedent("""
    from prefect import flow

    @flow(name="mlm-pretraining", flow_run_name="alerts-test-failing-run")
    def failing():
        raise RuntimeError("planted failure for the alerts test")

    state = failing(return_state=True)
    print("FLOW_RUN_ID", state.state_details.flow_run_id, state.name)
""")


#: Saves a notification block of the operator's own, `custom-webhook/ops`.
OPS_BLOCK = textwrap.dedent("""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    CustomWebhookNotificationBlock(name="ops", url={url!r}, json_data={{"t": "{{{{body}}}}"}}
                                   ).save("ops", overwrite=True)
""")


class _Receiver(BaseHTTPRequestHandler):
    """Puts each POST's (path, JSON body) on the server's `received` queue; answers 204."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(length).decode()
        self.server.received.put((self.path, self.headers.get("Content-Type"), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def receiver():
    """A webhook receiver on a free loopback port: (URL, queue of requests)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = queue.Queue()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hooks/mlm-alerts?token=t0ps3cret", \
            server.received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory):
    """Environment for processes that talk to a `prefect server start` of this module."""
    tmp = tmp_path_factory.mktemp("alerts")
    url, proc = start_prefect_server(tmp / "server-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=url, PREFECT_HOME=str(tmp / "client-home"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    try:
        yield env
    finally:
        stop(proc)
        log = tmp / "server-home" / "server.log"
        if log.exists():
            print("server log tail:\n" + log.read_text()[-1500:])


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    """`mlm-pipeline ARGS` in a fresh process; fails the test on a non-zero status."""
    done = subprocess.run([str(BIN / "mlm-pipeline"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"$ mlm-pipeline {' '.join(args)}\n{done.stdout}", end="")
    return done


def _server_state(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", LIST_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_install_twice_then_a_failed_run_notifies_the_webhook(prefect_env, receiver, tmp_path):
    url, received = receiver
    first = _cli(prefect_env, "alerts", "install", "--webhook-url", url)
    assert f"automation {FAILURE_NAME}: created" in first.stdout
    assert f"automation {ZOMBIE_NAME}: created" in first.stdout
    second = _cli(prefect_env, "alerts", "install", "--webhook-url", url)
    assert f"automation {FAILURE_NAME}: updated" in second.stdout
    assert f"automation {ZOMBIE_NAME}: updated" in second.stdout
    assert "t0ps3cret" not in first.stdout + second.stdout  # the URL's token stays hidden

    state = _server_state(prefect_env)
    assert len(state[FAILURE_NAME]) == 1 and len(state[ZOMBIE_NAME]) == 1
    (failure,), (zombie,) = state[FAILURE_NAME], state[ZOMBIE_NAME]
    assert set(failure["trigger"]["expect"]) == {
        "prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"}
    assert failure["actions"][0]["type"] == "send-notification"
    spec = yaml.safe_load(ZOMBIE_FILE.read_text())["automations"][0]
    assert zombie["trigger"]["after"] == spec["trigger"]["after"]
    assert zombie["trigger"]["within"] == spec["trigger"]["within"]
    assert zombie["actions"][0]["type"] == spec["actions"][0]["type"]
    (block,) = [b for b in state["blocks"] if b["slug"] == "custom-webhook"]
    assert failure["actions"][0]["block_document_id"] is not None
    assert "t0ps3cret" not in json.dumps(block)  # kept as a secret, shown obscured

    script = tmp_path / "failing_flow.py"
    script.write_text(FAILING_FLOW)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=prefect_env,
                         capture_output=True, text=True, timeout=300, check=False)
    line = next((x for x in run.stdout.splitlines() if x.startswith("FLOW_RUN_ID")), None)
    assert line is not None, run.stdout + run.stderr
    _, flow_run_id, state_name = line.split()
    assert state_name == "Failed"

    deadline = time.monotonic() + NOTIFY_WAIT_S
    requests = []
    while time.monotonic() < deadline and not requests:
        try:
            requests.append(received.get(timeout=1))
        except queue.Empty:
            pass
    assert requests, f"no notification within {NOTIFY_WAIT_S} s"
    path, content_type, body = requests[0]
    print(f"received POST {path} ({content_type}):\n{body}")
    assert path == "/hooks/mlm-alerts?token=t0ps3cret"
    assert content_type == "application/json"
    payload = json.loads(body)
    assert set(payload) == {"text", "subject", "body"}
    assert "alerts-test-failing-run" in payload["subject"]
    assert "mlm-pretraining" in payload["subject"] and "Failed" in payload["subject"]
    assert flow_run_id in payload["body"]
    assert "entered state Failed" in payload["body"]
    assert "planted failure for the alerts test" in payload["body"]
    assert payload["text"] == payload["subject"] + "\n" + payload["body"]


def test_install_adopts_hand_made_copies_and_remove_deletes_everything(prefect_env, receiver):
    """The zombie automation created by hand, twice, as the docs once said: `install`
    keeps one (updated) and deletes the other; `remove` then leaves none."""
    url, _ = receiver
    _cli(prefect_env, "alerts", "remove")
    for _ in range(2):
        subprocess.run([str(BIN / "prefect"), "automation", "create", "--from-file",
                        str(ZOMBIE_FILE)], cwd=ROOT, env=prefect_env, capture_output=True,
                       text=True, timeout=120, check=True)
    assert len(_server_state(prefect_env)[ZOMBIE_NAME]) == 2
    installed = _cli(prefect_env, "alerts", "install", "--webhook-url", url)
    assert f"automation {ZOMBIE_NAME}: updated, 1 duplicate(s) deleted" in installed.stdout
    assert f"automation {FAILURE_NAME}: created" in installed.stdout
    assert len(_server_state(prefect_env)[ZOMBIE_NAME]) == 1

    # retarget to a block saved beforehand (as an email block would be): used, kept
    subprocess.run([sys.executable, "-c", OPS_BLOCK.format(url=url + "&to=ops")], cwd=ROOT,
                   env=prefect_env, capture_output=True, text=True, timeout=120, check=True)
    retargeted = _cli(prefect_env, "alerts", "install", "--block", "custom-webhook/ops")
    assert "block custom-webhook/ops: existing notification block" in retargeted.stdout
    state = _server_state(prefect_env)
    (ops,) = [b for b in state["blocks"] if b["name"] == "ops"]
    (failure,) = state[FAILURE_NAME]
    assert failure["actions"][0]["block_document_id"] == ops["id"]
    removed = _cli(prefect_env, "alerts", "remove")
    assert f"automation {FAILURE_NAME}: 1 deleted" in removed.stdout
    assert f"automation {ZOMBIE_NAME}: 1 deleted" in removed.stdout
    state = _server_state(prefect_env)
    assert state[FAILURE_NAME] == [] and state[ZOMBIE_NAME] == []
    assert [b["name"] for b in state["blocks"] if b["slug"] == "custom-webhook"] == ["ops"]
