"""Regenerate `mlflow-run-metrics.png`, the README's picture of the MLflow UI.

    python benchmarks/figures/take_mlflow_screenshot.py --store DIR [--run-id ID]
        [--chromium PATH] [--out PNG]

What it shows: the run page's "Model metrics" tab (the `Run page:` link a run prints) of one
finished run, its charts filtered to the held-out curves (eval/loss, eval/mlm_accuracy,
eval/top5_accuracy, at the 15 % masking rate) and the training curves (train/loss,
train/lr, train/grad_norm), the MLflow Assistant panel closed. 1400 x 1080 px.

Store: DIR holds a tracking store as `mlm-pipeline run` leaves it in its working directory
(`mlflow.db`, `mlartifacts/`); the picture in the repository is of a default run,
`mlm-pipeline run configs/tiny.yaml` (800 steps, fine-tuning evaluation on). DIR is copied
to a temporary directory first (the MLflow server may migrate the database it serves),
served there with `mlflow server` on a free local port, and removed afterwards. Without
`--run-id`, the newest finished run of the store is shown.

Browser: any Chromium driven by the `playwright` package (`pip install playwright`; not a
dependency of the project). Where `playwright install chromium` cannot download, the npm
package `@sparticuz/chromium` bundles one:
`cd /tmp/chromium-npm && npm install @sparticuz/chromium &&
node -e "require('@sparticuz/chromium').default.executablePath().then(console.log)"`
unpacks it to `/tmp/chromium` (the default of `--chromium`; `$CHROMIUM` overrides it).
A PNG over 300 KB is re-encoded with a 256-colour palette (Pillow).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

#: The charts kept on the run page: MLflow's chart search takes a regular expression over
#: the full metric key.
CHARTS = r"^(eval/(loss|mlm_accuracy|top5_accuracy)|train/(loss|lr|grad_norm))$"
VIEWPORT = {"width": 1400, "height": 1080}
MAX_BYTES = 300_000
DEFAULT_OUT = Path(__file__).resolve().with_name("mlflow-run-metrics.png")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def newest_finished_run(tracking_uri: str) -> tuple[str, str]:
    """(experiment id, run id) of the newest FINISHED run in the store.

    Raises SystemExit naming the store when it holds no finished run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, "attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"{tracking_uri}: no finished run")
    return runs[0].info.experiment_id, runs[0].info.run_id


def serve(store: Path, port: int) -> subprocess.Popen:
    """Start `mlflow server` on the copied store and wait (up to 120 s) for its /health."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server",
         "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
         "--artifacts-destination", str(store / "mlartifacts"),
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlflow server exited {proc.returncode} on {store}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    stop(proc)
    raise SystemExit(f"mlflow server on port {port}: no /health answer in 120 s")


def stop(proc: subprocess.Popen) -> None:
    """End the server and the workers it started (its own process group)."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def shoot(url: str, chromium: str, out: Path) -> None:
    """Open `url` in headless Chromium, close the assistant, filter the charts, screenshot."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(url, wait_until="domcontentloaded", timeout=60_000)
        search = page.get_by_placeholder("Search metric charts")
        search.wait_for(timeout=60_000)
        close = page.get_by_role("button", name="Close")
        if close.count():
            close.first.click()
        search.fill(CHARTS)
        page.get_by_text("grad_norm", exact=True).wait_for(timeout=30_000)
        page.wait_for_timeout(5_000)  # the charts draw their lines progressively
        page.screenshot(path=str(out))
        browser.close()


def shrink(png: Path) -> None:
    """Re-encode `png` with a 256-colour palette when it is over MAX_BYTES."""
    if png.stat().st_size <= MAX_BYTES:
        return
    from PIL import Image

    with Image.open(png) as im:
        small = im.convert("RGB").quantize(256)
    small.save(png, optimize=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True,
                        help="directory holding mlflow.db and mlartifacts/ (copied, not changed)")
    parser.add_argument("--run-id", help="run to show (default: the newest finished run)")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/tmp/chromium"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not (args.store / "mlflow.db").is_file():
        raise SystemExit(f"{args.store}: no mlflow.db")
    with tempfile.TemporaryDirectory(prefix="mlflow-shot-") as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        shutil.copy2(args.store / "mlflow.db", store / "mlflow.db")
        if (args.store / "mlartifacts").is_dir():
            shutil.copytree(args.store / "mlartifacts", store / "mlartifacts")
        tracking_uri = f"sqlite:///{store / 'mlflow.db'}"
        if args.run_id:
            from mlflow.tracking import MlflowClient

            run_id = args.run_id
            experiment_id = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
        else:
            experiment_id, run_id = newest_finished_run(tracking_uri)
        port = free_port()
        server = serve(store, port)
        try:
            shoot(f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs/{run_id}"
                  "/model-metrics?workflowType=machine_learning", args.chromium, args.out)
        finally:
            stop(server)
    shrink(args.out)
    print(f"{args.out}: run {run_id}, {args.out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
