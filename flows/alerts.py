"""`mlm-pipeline alerts install|remove`: the Prefect automations an operator needs, created
idempotently on the server `PREFECT_API_URL` names (each looked up by name, updated in place).

- `FAILURE_AUTOMATION`: a flow run of `FLOW_NAMES` entering Failed, Crashed or TimedOut
  (events `prefect.flow-run.<state name>`) sends a notification naming the flow, flow run,
  deployment, state and message: through a webhook (`--webhook-url`: a
  `CustomWebhookNotificationBlock` saved as `WEBHOOK_BLOCK`, POSTing `WEBHOOK_JSON`, the URL
  kept in its secrets so the UI shows it obscured) or an existing block (`--block TYPE/NAME`).
- The zombie-run automation of `flows/automations/crash-zombie-flows.yaml`: a running flow
  run that stops sending heartbeats is marked Crashed, which in turn notifies.

A failing stage flow inside `mlm-pretraining` fails its parent too: one message for each.
Only Prefect's public Python API is used.
Prefect's guide: https://docs.prefect.io/v3/concepts/automations (triggers, actions, Python SDK).
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

#: Name of the failure automation on the server.
FAILURE_AUTOMATION = "mlm-pipeline-flow-run-failed"
#: The zombie-run automation's definition (one automation, `prefect automation create
#: --from-file` format), installed with the flows (package data), so a wheel has it too.
ZOMBIE_FILE = Path(__file__).resolve().parent / "automations" / "crash-zombie-flows.yaml"
#: The zombie-run automation's name, should its file be missing when `remove` runs.
ZOMBIE_AUTOMATION = "crash-zombie-flows"
#: Name of the webhook block document `--webhook-url` saves (type `custom-webhook`).
WEBHOOK_BLOCK = "mlm-pipeline-alerts"
#: The project's flows (the `@flow(name=...)` of flows/*.py; a test keeps the list whole).
FLOW_NAMES = ("mlm-phases", "mlm-pretraining", "mlm-sweep", "prepare-data",
              "prepare-data-dask", "train-evaluate")
#: State names whose flow-run events notify (TimedOut is a Failed state of its own name).
ALERT_STATES = ("Failed", "Crashed", "TimedOut")
#: The notification's subject and body: Jinja templates Prefect renders with the flow run,
#: its flow and deployment (`prefect.server.events.actions.SendNotification`).
SUBJECT = "mlm-pipeline: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = (
    "Flow run {{ flow_run.name }} (id {{ flow_run.id }}) of flow {{ flow.name }}"
    "{% if deployment %}, deployment {{ deployment.name }}{% endif %}, "
    "entered state {{ flow_run.state.name }} at {{ flow_run.state.timestamp }}.\n"
    "Message: {{ flow_run.state.message }}\n"
    "Tags: {{ (flow_run.tags | join(', ')) or 'none' }}"
    "{% if flow_run|ui_url %}\nUI: {{ flow_run|ui_url }}{% endif %}"
)
#: The JSON object the webhook receives (`text` as Slack and Mattermost read it).
WEBHOOK_JSON = {"text": "{{subject}}\n{{body}}", "subject": "{{subject}}", "body": "{{body}}"}


def _api_url() -> str:
    """The Prefect API the command acts on; RuntimeError without one (automations on a
    temporary server would vanish with it)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise RuntimeError("alerts: PREFECT_API_URL is not set; point it at the Prefect "
                           "server whose flow runs to watch (e.g. http://HOST:4200/api)")
    return url


def failure_automation(block_document_id: Any) -> Any:
    """The failure automation (`prefect.automations.Automation`, not yet on the server):
    one notification through the block `block_document_id` (UUID) for each flow-run event
    of `ALERT_STATES` whose flow is one of `FLOW_NAMES`."""
    from prefect.automations import Automation
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    trigger = EventTrigger(
        expect={f"prefect.flow-run.{state}" for state in ALERT_STATES},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow",
                       "prefect.resource.name": list(FLOW_NAMES)},
        for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1, within=0)
    return Automation(
        name=FAILURE_AUTOMATION, enabled=True, trigger=trigger,
        description=f"Notify when a flow run of {', '.join(FLOW_NAMES)} enters "
                    f"{', '.join(ALERT_STATES)} (mlm-pipeline alerts install).",
        actions=[SendNotification(block_document_id=block_document_id, subject=SUBJECT,
                                  body=BODY)])


def zombie_automation(path: Path = ZOMBIE_FILE) -> Any:
    """The zombie-run automation defined in `path` (an `automations:` list of one).

    Raises:
        FileNotFoundError: `path` is missing (a damaged install, or a wrong
            `--zombie-file`).
        ValueError: `path` does not hold exactly one valid automation (pydantic's message,
            with the file named).
    """
    import yaml
    from prefect.automations import Automation

    if not path.is_file():
        raise FileNotFoundError(f"alerts: {path}: no such file (the zombie-run automation; "
                                "installed with the flows; reinstall, or pass --zombie-file)")
    specs = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("automations")
    if not isinstance(specs, list) or len(specs) != 1:
        raise ValueError(f"alerts: {path}: `automations` must list exactly one automation")
    try:
        return Automation.model_validate(specs[0])
    except ValueError as exc:
        raise ValueError(f"alerts: {path}: not a valid Prefect automation: {exc}") from exc


def _check_webhook_url(url: str) -> None:
    """Raises ValueError unless `url` is an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"alerts: --webhook-url {url!r} is not an http(s) URL with a host")


def _webhook_block(url: str) -> tuple[Any, str]:
    """Save the webhook block `WEBHOOK_BLOCK` for `url`; (its id, a line without the URL's
    path or query, which often hold a token)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name=WEBHOOK_BLOCK, url="{{webhook_url}}", method="POST", json_data=WEBHOOK_JSON,
        secrets={"webhook_url": url})
    host = urllib.parse.urlsplit(url)
    return block.save(WEBHOOK_BLOCK, overwrite=True), (
        f"block custom-webhook/{WEBHOOK_BLOCK}: POST JSON to {host.scheme}://{host.netloc}/... "
        "(saved)")


def _existing_block(client: Any, slug_name: str) -> tuple[Any, str]:
    """(block document id, a line) of the saved block `TYPE/NAME`; ValueError if none."""
    from prefect.exceptions import ObjectNotFound

    slug, _, name = slug_name.partition("/")
    if not slug or not name:
        raise ValueError(f"alerts: --block {slug_name!r}: expected TYPE/NAME "
                         "(e.g. sendgrid-email/ops; `prefect block ls` lists them)")
    try:
        document = client.read_block_document_by_name(name=name, block_type_slug=slug)
    except ObjectNotFound:
        raise ValueError(f"alerts: --block {slug_name!r}: no such block on the server "
                         "(`prefect block ls` lists them)") from None
    return document.id, f"block {slug_name}: existing notification block (used as it is)"


def _put(client: Any, automation: Any) -> str:
    """Create `automation`, or update the one of its name (deleting further copies);
    returns a line saying which."""
    existing = client.read_automations_by_name(name=automation.name)
    for extra in existing[1:]:
        client.delete_automation(extra.id)
    if existing:
        automation.id = existing[0].id
        automation.update()
        done = "updated" + (f", {len(existing) - 1} duplicate(s) deleted"
                            if len(existing) > 1 else "")
    else:
        automation.create()
        done = "created"
    return f"automation {automation.name}: {done} (id {automation.id})"


def install(webhook_url: str | None = None, block: str | None = None,
            zombie_file: str | None = None) -> list[str]:
    """Create or update the failure and zombie-run automations on the server of
    `PREFECT_API_URL` (see the module docstring).

    Args:
        webhook_url: http(s) URL the failure notification is POSTed to (JSON
            `WEBHOOK_JSON`); saved in the block `custom-webhook/WEBHOOK_BLOCK`.
        block: instead, an existing notification block `TYPE/NAME` (e.g. email).
        zombie_file: the zombie-run automation's YAML (default `ZOMBIE_FILE`).

    Returns:
        One line per object written (block, then each automation: created or updated).

    Raises:
        ValueError: neither or both of `webhook_url` and `block`; a malformed URL; an
            unknown block; an invalid zombie file.
        FileNotFoundError: the zombie file is missing.
        RuntimeError: `PREFECT_API_URL` is not set.
    """
    from prefect.client.orchestration import get_client

    if (webhook_url is None) == (block is None):
        raise ValueError("alerts install: give exactly one of --webhook-url URL and "
                         "--block TYPE/NAME")
    zombie = zombie_automation(Path(zombie_file) if zombie_file else ZOMBIE_FILE)
    if webhook_url is not None:
        _check_webhook_url(webhook_url)
    lines = [f"Prefect API: {_api_url()}"]
    with get_client(sync_client=True) as client:
        block_id, line = (_webhook_block(webhook_url) if webhook_url is not None
                          else _existing_block(client, block))
        lines.append(line)
        lines += [_put(client, a) for a in (failure_automation(block_id), zombie)]
    return lines


def remove(zombie_file: str | None = None) -> list[str]:
    """Delete both automations (every copy of each name) and the webhook block
    `WEBHOOK_BLOCK` from the server of `PREFECT_API_URL`; a block given with `--block` is
    left alone. Returns one line per name.

    Raises:
        RuntimeError: `PREFECT_API_URL` is not set.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    path = Path(zombie_file) if zombie_file else ZOMBIE_FILE
    zombie_name = zombie_automation(path).name if path.is_file() else ZOMBIE_AUTOMATION
    lines = [f"Prefect API: {_api_url()}"]
    with get_client(sync_client=True) as client:
        for name in (FAILURE_AUTOMATION, zombie_name):
            found = client.read_automations_by_name(name=name)
            for automation in found:
                client.delete_automation(automation.id)
            lines.append(f"automation {name}: {len(found)} deleted")
        try:
            document = client.read_block_document_by_name(
                name=WEBHOOK_BLOCK, block_type_slug="custom-webhook")
            client.delete_block_document(document.id)
            lines.append(f"block custom-webhook/{WEBHOOK_BLOCK}: deleted")
        except ObjectNotFound:
            lines.append(f"block custom-webhook/{WEBHOOK_BLOCK}: none")
    return lines


def alerts(action: str, webhook_url: str | None = None, block: str | None = None,
           zombie_file: str | None = None) -> list[str]:
    """The `alerts` command: `install` (with `webhook_url` or `block`) or `remove`; returns
    the lines to print. Errors as `install` and `remove` raise them; `remove` refuses a
    notification target (ValueError)."""
    if action == "install":
        return install(webhook_url, block, zombie_file)
    if webhook_url is not None or block is not None:
        raise ValueError("alerts remove: takes no --webhook-url or --block")
    return remove(zombie_file)
